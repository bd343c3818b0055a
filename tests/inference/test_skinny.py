"""inference/skinny.py: a decode step's linears split across threads equal `F.linear` (within float
rounding), only while the engine turns the split on, only for skinny products of wide layers."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch
import torch.nn.functional as F

from rlproxy.inference.embedded import EmbeddedBackend
from rlproxy.inference.skinny import MAX_ROWS, SplitLinears


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Linear(96, 512, bias=False),
        torch.nn.Linear(512, 96 * 4, bias=True),
        torch.nn.Linear(96 * 4, 8),  # narrow (a LoRA A): never patched
        torch.nn.Linear(8, 300),  # 300 is not a multiple of 8 parts
    )


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("shape", [(1, 1, 96), (8, 1, 96), (MAX_ROWS, 96), (2, 8, 96)])
def test_split_equals_linear(parts: int, shape: tuple[int, ...]) -> None:
    model = _model()
    split = SplitLinears(model)
    assert split.patched == 3  # the two wide layers and the one of width 300, not the narrow one
    first, second = model[0], model[1]
    x = torch.randn(*shape)
    want1 = F.linear(x, first.weight)
    split.parts = parts
    got1 = first(x)
    assert got1.shape == want1.shape
    torch.testing.assert_close(got1, want1, rtol=1e-5, atol=1e-5)
    h = torch.randn(*shape[:-1], 512)
    torch.testing.assert_close(second(h), F.linear(h, second.weight, second.bias), rtol=1e-5, atol=1e-5)


def test_split_is_off_until_set_and_skips_what_it_cannot_split() -> None:
    model = _model()
    split = SplitLinears(model)
    x = torch.randn(4, 96)
    assert torch.equal(model[0](x), F.linear(x, model[0].weight))  # parts = 0: F.linear itself
    split.parts = 2
    prefill = torch.randn(MAX_ROWS + 1, 96)  # not skinny: F.linear, bit for bit
    assert torch.equal(model[0](prefill), F.linear(prefill, model[0].weight))
    split.parts = 8  # 300 outputs do not split 8 ways: F.linear
    h = torch.randn(3, 8)
    assert torch.equal(model[3](h), F.linear(h, model[3].weight, model[3].bias))


def test_the_split_really_runs_bmm(monkeypatch: pytest.MonkeyPatch) -> None:
    model = _model()
    split = SplitLinears(model)
    calls = []
    real = torch.bmm
    monkeypatch.setattr(torch, "bmm", lambda a, b: calls.append(a.shape) or real(a, b))
    split.parts = 2
    model[0](torch.randn(8, 96))
    assert calls == [torch.Size([2, 8, 96])]


def test_an_engine_on_two_threads_decodes_through_the_split_and_stays_batch_invariant(
    tiny_model_dir, loop_thread, monkeypatch: pytest.MonkeyPatch
) -> None:
    split_calls = []
    real = torch.bmm

    def counted(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        split_calls.append(a.shape[0])
        return real(a, b)

    backend = EmbeddedBackend(str(tiny_model_dir), threads=2, max_batch=16)
    loop_thread.run(backend.start())
    try:
        assert backend.engine._split.patched > 0
        client = openai.OpenAI(base_url=f"{backend.base_url}/v1", api_key="x", max_retries=0, timeout=120)

        def ids(k: int) -> list[int]:
            r = client.chat.completions.create(
                model=backend.served_model,
                messages=[{"role": "user", "content": f"question {k} " * (1 + k % 3)}],
                max_tokens=12 + 2 * k,
                seed=100 + k,
                temperature=1.0,
                extra_body={"return_token_ids": True, "ignore_eos": True},
            )
            return r.model_dump()["choices"][0]["token_ids"]

        solo = [ids(k) for k in range(6)]
        monkeypatch.setattr(torch, "bmm", counted)
        with ThreadPoolExecutor(6) as pool:
            together = list(pool.map(ids, range(6)))
        assert together == solo
        assert split_calls and set(split_calls) == {2}  # decode steps ran split two ways
    finally:
        monkeypatch.undo()
        loop_thread.run(backend.stop())
