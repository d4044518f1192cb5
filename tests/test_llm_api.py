"""The public Python API as DESIGN.md promises it: LLM, generate, SamplingParams, RequestOutput, close."""

import pytest

import kunlun_infer as ki
from tests.engine.tiny_models import build_tiny_model, engine_overrides


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("api-model"), "llama")


@pytest.fixture(scope="module")
def llm(folder):
    with ki.LLM(model=str(folder), overrides=engine_overrides()) as llm:
        yield llm


GREEDY = ki.SamplingParams(max_tokens=5, temperature=0.0)


def test_public_names_are_exported():
    for name in ("LLM", "SamplingParams", "RequestOutput", "compose_config", "KunlunInferError", "RequestError"):
        assert hasattr(ki, name), name
    assert issubclass(ki.RequestError, ValueError) and issubclass(ki.RequestError, ki.KunlunInferError)


def test_generate_accepts_text_lists_of_text_and_token_lists(llm):
    one = llm.generate("def f(x):", GREEDY, use_tqdm=False)
    assert len(one) == 1 and isinstance(one[0], ki.RequestOutput)
    assert one[0].prompt == "def f(x):" and one[0].finished and len(one[0].token_ids) <= 5
    texts = llm.generate(["a", "def f(x):", "bb"], GREEDY, use_tqdm=False)
    assert [o.prompt for o in texts] == ["a", "def f(x):", "bb"]
    assert texts[1].token_ids == one[0].token_ids
    ids = llm.generate([one[0].prompt_token_ids, [1, 2, 3]], GREEDY, use_tqdm=False)
    assert ids[0].token_ids == one[0].token_ids and ids[0].prompt is None
    assert llm.generate([1, 2, 3], GREEDY, use_tqdm=False)[0].token_ids == ids[1].token_ids


def test_generate_takes_one_params_per_prompt(llm):
    outs = llm.generate([[5, 6], [7, 8]], [ki.SamplingParams(max_tokens=2, temperature=0, ignore_eos=True),
                                           ki.SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)],
                        use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [2, 4]
    with pytest.raises(ki.RequestError) as err:
        llm.generate([[5], [6]], [GREEDY], use_tqdm=False)
    assert err.value.field == "params"


def test_a_bad_prompt_refuses_the_batch_before_anything_runs(llm):
    with pytest.raises(ki.RequestError) as err:
        llm.generate([[1, 2], [], [3]], GREEDY, use_tqdm=False)
    assert err.value.field == "prompt"
    assert not llm.engine.has_unfinished()
    assert llm.generate([[1, 2]], GREEDY, use_tqdm=False)[0].finished


def test_progress_bar_can_be_switched_off(llm, capsys):
    llm.generate([[1, 2]], GREEDY, use_tqdm=True)
    assert "generate" in capsys.readouterr().err
    llm.generate([[1, 2]], GREEDY, use_tqdm=False)
    assert capsys.readouterr().err == ""


def test_from_config_and_close(folder):
    cfg = ki.compose_config(engine_overrides(model__path=str(folder)))
    llm = ki.LLM.from_config(cfg)
    assert llm.generate([[4, 5]], GREEDY, use_tqdm=False)[0].finished
    llm.close()
    llm.close()  # idempotent
    assert llm.engine.runtime.closed
    with pytest.raises(ki.KunlunInferError, match="closed"):
        llm.engine.add_request([1], GREEDY)


def test_model_without_tokenizer_takes_token_ids_only(folder, tmp_path):
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(folder, bare)
    (bare / "tokenizer.json").unlink()
    with ki.LLM(model=str(bare), overrides=engine_overrides()) as llm:
        out = llm.generate([[1, 2, 3]], GREEDY, use_tqdm=False)[0]
        assert len(out.token_ids) >= 1 and out.text == ""
        with pytest.raises(ki.RequestError, match="token ids") as err:
            llm.generate("hello", GREEDY, use_tqdm=False)
        assert err.value.field == "prompt"


def test_missing_model_folder_is_a_clear_error(tmp_path):
    with pytest.raises(ki.ModelLoadError, match="config.json"):
        ki.LLM(model=str(tmp_path / "nowhere"), overrides=engine_overrides())


def test_scheduler_presets_reach_the_engine(folder):
    with ki.LLM(model=str(folder), overrides=["scheduler=latency", "model.max_model_len=256"]) as llm:
        scheduler = llm.engine.scheduler
        assert (scheduler.max_num_seqs, scheduler.max_num_batched_tokens) == (4, 512)
        assert llm.engine.stats()["kv_blocks_total"] == 4 * 256 // 16
        assert len(llm.generate([[1, 2]] * 6, GREEDY, use_tqdm=False)) == 6


@pytest.mark.parametrize("override, key", [
    ("cache.block_size=0", "cache.block_size"),
    ("cache.num_blocks=0", "cache.num_blocks"),
    ("cache.memory_fraction=1.5", "cache.memory_fraction"),
    ("scheduler.max_num_seqs=0", "scheduler.max_num_seqs"),
    ("scheduler.max_num_batched_tokens=-4", "scheduler.max_num_batched_tokens"),
    ("model.max_model_len=100000", "model.max_model_len"),
    ("model.dtype=int8", "model.dtype"),
])
def test_engine_settings_out_of_range_name_the_key(folder, override, key):
    with pytest.raises(ki.ConfigError, match=key.replace(".", r"\.")):
        ki.LLM(model=str(folder), overrides=[override])
