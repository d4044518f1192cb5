"""int8 on the trained default model: the validation loss moves by well under the 2% the issue allows.

The loss is the engine's own (``prompt_logprobs`` over validation windows the
training never saw, as in ``tests/test_default_model.py``), with and without
``model.quantization=int8`` on the same windows.
"""

from __future__ import annotations

import kunlun_infer as ki
from tests.test_default_model import validation_windows  # noqa: F401 - fixture
from tests.torch_threads import one_thread  # noqa: F401 - autouse: one torch thread per test


def validation_loss(overrides: list[str], windows) -> float:
    with ki.LLM(overrides=overrides) as llm:
        outputs = llm.generate([w.tolist() for w in windows],
                               ki.SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0), use_tqdm=False)
    scored = [entry[token] for w, out in zip(windows, outputs)
              for token, entry in zip(w.tolist()[1:], out.prompt_logprobs[1:])]
    return -sum(scored) / len(scored)


def test_int8_validation_loss_stays_within_one_percent(validation_windows):  # noqa: F811
    full = validation_loss([], validation_windows)
    int8 = validation_loss(["model.quantization=int8"], validation_windows)
    assert int8 != full  # the weights really were quantized
    assert abs(int8 - full) < 0.01 * full, (full, int8)
