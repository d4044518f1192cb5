"""Chat: the model's own template, rendered to the same token ids transformers gives, then generated."""

import json

import pytest

import kunlun_infer as ki
from kunlun_infer.chat import load_chat_template
from tests.chat_models import RICH_TEMPLATE, build_chat_model, write_chat_tokenizer
from tests.engine.tiny_models import engine_overrides
from tests.torch_threads import one_thread  # noqa: F401 - autouse: one torch thread per test

CONVERSATIONS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "  Be kind.  "}, {"role": "user", "content": "Wie geht's? 你好 <b>&</b>"},
     {"role": "assistant", "content": "Gut."}, {"role": "user", "content": "Und dann?"}],
]
TOOLS = [{"type": "function", "function": {"name": "weather", "description": "Wetter für <Ort> & Zeit",
                                            "parameters": {"type": "object", "properties": {"city": {}}}}}]
GREEDY = ki.SamplingParams(max_tokens=6, temperature=0.0)


@pytest.fixture(scope="module")
def chat_folder(tmp_path_factory):
    return build_chat_model(tmp_path_factory.mktemp("chat-model"))


@pytest.fixture(scope="module")
def llm(chat_folder):
    with ki.LLM(model=str(chat_folder), overrides=engine_overrides()) as llm:
        yield llm


def hf_chat_ids(folder, messages, **kwargs):
    import transformers as tf

    tokenizer = tf.AutoTokenizer.from_pretrained(folder)
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                              return_dict=False, **kwargs))


@pytest.mark.parametrize("template", ["chatml", "rich"])
def test_prompt_ids_equal_transformers_apply_chat_template(tmp_path, template):
    folder = tmp_path / template
    folder.mkdir()
    if template == "chatml":
        write_chat_tokenizer(folder)
    else:
        write_chat_tokenizer(folder, RICH_TEMPLATE, bos_token="<|endoftext|>")
    from kunlun_infer.chat import encode_prompt
    from kunlun_infer.models import load_tokenizer

    tokenizer = load_tokenizer(folder)
    chat_template = load_chat_template(folder)
    for messages in CONVERSATIONS:
        for tools in (None, TOOLS):
            ours = encode_prompt(tokenizer, chat_template.render(messages, tools=tools))
            assert ours == hf_chat_ids(folder, messages, tools=tools), (template, messages, tools)


def test_rich_template_renders_whitespace_tools_and_special_tokens_like_transformers(tmp_path):
    write_chat_tokenizer(tmp_path, RICH_TEMPLATE, bos_token="<|endoftext|>")
    text = load_chat_template(tmp_path).render(CONVERSATIONS[1], tools=TOOLS)
    # block tags leave no indentation or newline behind (lstrip_blocks, trim_blocks)
    assert text.startswith("<|endoftext|>\n<|im_start|>user\n[Be kind.]\nWie geht's?")
    # tojson keeps non-ASCII and does not HTML-escape
    assert json.dumps(TOOLS[0], ensure_ascii=False) in text and "<Ort> & Zeit" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_chat_generates_what_generate_gives_for_the_rendered_prompt(llm, chat_folder):
    one = llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False)
    assert len(one) == 1 and one[0].finished
    expected_ids = hf_chat_ids(chat_folder, CONVERSATIONS[0])
    assert one[0].prompt_token_ids == expected_ids
    assert one[0].prompt.endswith("<|im_start|>assistant\n")
    direct = llm.generate([expected_ids], GREEDY, use_tqdm=False)[0]
    assert one[0].token_ids == direct.token_ids and one[0].text == direct.text


def test_chat_takes_a_list_of_conversations_in_order(llm, chat_folder):
    outs = llm.chat(CONVERSATIONS, GREEDY, use_tqdm=False)
    assert [o.prompt_token_ids for o in outs] == [hf_chat_ids(chat_folder, c) for c in CONVERSATIONS]
    assert outs[0].token_ids == llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False)[0].token_ids


def test_template_errors_and_malformed_messages_are_request_errors(tmp_path, llm):
    write_chat_tokenizer(tmp_path, RICH_TEMPLATE)
    template = load_chat_template(tmp_path)
    with pytest.raises(ki.RequestError, match="roles must alternate") as err:
        template.render([{"role": "assistant", "content": "hi"}])
    assert err.value.field == "messages"
    with pytest.raises(ki.RequestError) as err:
        llm.chat([{"content": "no role"}], GREEDY, use_tqdm=False)
    assert err.value.field == "messages[0].role"
    with pytest.raises(ki.RequestError, match="no 'content'") as err:
        llm.chat([{"role": "user"}], GREEDY, use_tqdm=False)
    assert err.value.field == "messages[0].content"
    with pytest.raises(ki.RequestError, match="string or a list") as err:
        llm.chat([{"role": "user", "content": 7}], GREEDY, use_tqdm=False)
    assert err.value.field == "messages[0].content"
    with pytest.raises(ki.RequestError, match="at least one message"):
        llm.chat([], GREEDY, use_tqdm=False)
    assert not llm.engine.has_unfinished()


def test_sandbox_keeps_templates_away_from_python_internals(tmp_path):
    write_chat_tokenizer(tmp_path, "{{ messages.__class__.__mro__ }}")
    with pytest.raises(ki.RequestError, match="unsafe"):
        load_chat_template(tmp_path).render([{"role": "user", "content": "x"}])


def test_model_without_template_names_the_file(tmp_path):
    folder = build_chat_model(tmp_path / "no-template", chat_template=None)
    with ki.LLM(model=str(folder), overrides=engine_overrides()) as llm:
        with pytest.raises(ki.RequestError, match="tokenizer_config.json") as err:
            llm.chat(CONVERSATIONS[0], GREEDY, use_tqdm=False)
    assert str(folder / "tokenizer_config.json") in str(err.value)


def test_chat_template_jinja_file_wins_over_the_config_key(tmp_path):
    write_chat_tokenizer(tmp_path)
    (tmp_path / "chat_template.jinja").write_text("{% for m in messages %}<<{{ m['content'] }}>>{% endfor %}")
    assert load_chat_template(tmp_path).render([{"role": "user", "content": "x"}]) == "<<x>>"
