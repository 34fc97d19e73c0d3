"""The sampler alone: greedy rows, the inverse-CDF draw from softmax(logits / T), top-k and top-p
masks. On a GPU the draw is the Triton kernels (the `gpu` tests), on the CPU their torch reference.
Chunks are cut to 16 logits here, so small vocabularies span several chunks."""
import pytest
import torch

from nanoserve import kernels
from nanoserve.kernels import sampling
from nanoserve.layers import Sampler

SAMPLE_CHUNK = 16

ROWS = 20000
LOGITS = torch.tensor([0.0, 1.0, 2.0, -1.0])


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(sampling, "SAMPLE_CHUNK", SAMPLE_CHUNK)


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def frequencies(logits: torch.Tensor, temperature: float, device: str = "cpu", rows: int = ROWS,
                **masks) -> torch.Tensor:
    """Empirical frequency of each token over `rows` draws from the same logits (V,)."""
    torch.manual_seed(0)
    temps = torch.full((rows,), temperature, device=device)
    masks = {k: torch.full((rows,), v, device=device) for k, v in masks.items()}
    uniforms = torch.rand(rows, device=device)
    out = Sampler()(logits.repeat(rows, 1).to(device), temps, uniforms, **masks)
    return (torch.bincount(out, minlength=len(logits)) / rows).cpu()


@pytest.mark.parametrize("device", DEVICES)
def test_draws_match_softmax_with_temperature(device):
    for t in (0.5, 1.0, 2.0):
        torch.testing.assert_close(frequencies(LOGITS, t, device), torch.softmax(LOGITS / t, -1),
                                   atol=0.015, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
# whole chunks, and a padded last one
@pytest.mark.parametrize("vocab", [3 * SAMPLE_CHUNK, 3 * SAMPLE_CHUNK + 37])
def test_draws_match_softmax_across_chunks(device, vocab):
    # a few likely tokens in different chunks (the last one included) over a tail of unlikely ones
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(1))
    logits[[5, SAMPLE_CHUNK + 7, vocab - 1]] += 6
    expected = torch.softmax(logits / 0.8, -1)
    torch.testing.assert_close(frequencies(logits, 0.8, device, rows=50_000), expected,
                               atol=0.008, rtol=0)


def test_uniform_at_either_end_picks_a_possible_token():
    logits = torch.full((1, 2 * SAMPLE_CHUNK + 5), float("-inf"))
    logits[0, [3, SAMPLE_CHUNK + 9]] = torch.tensor([0.0, 1.0])  # every other token: probability 0
    for u, token in ((0.0, 3), (0.5, SAMPLE_CHUNK + 9), (1 - 2 ** -24, SAMPLE_CHUNK + 9)):
        assert kernels.sample_ref(logits, torch.ones(1), torch.tensor([u])).item() == token


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_keeps_the_k_most_likely(device):
    p = torch.softmax(LOGITS / 0.7, -1)
    expected = torch.tensor([0.0, p[1], p[2], 0.0]) / (p[1] + p[2])
    torch.testing.assert_close(frequencies(LOGITS, 0.7, device, top_ks=2), expected, atol=0.015,
                               rtol=0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    p = torch.softmax(LOGITS, -1)  # [0.087, 0.237, 0.644, 0.032]
    # the top token alone reaches 0.5
    assert frequencies(LOGITS, 1.0, top_ps=0.5).tolist() == [0.0, 0.0, 1.0, 0.0]
    kept = torch.tensor([0.0, p[1], p[2], 0.0]) / (p[1] + p[2])  # 0.644 < 0.8 <= 0.644 + 0.237
    torch.testing.assert_close(frequencies(LOGITS, 1.0, top_ps=0.8), kept, atol=0.015, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_are_the_argmax(device):
    logits = torch.randn(8, 3 * SAMPLE_CHUNK + 1, device=device)
    logits[0, 2 * SAMPLE_CHUNK + 4] = logits[0, 5] = 10.0  # a tie: the first index wins, as argmax
    temps = torch.tensor([0.0, 1.0] * 4, device=device)
    uniforms = torch.rand(8, device=device)
    for masks in ({}, {"top_ks": torch.full((8,), 3, device=device)},
                  {"top_ps": torch.full((8,), 0.9, device=device)}):
        out = Sampler()(logits, temps, uniforms, **masks)
        assert out[::2].tolist() == logits.argmax(-1)[::2].tolist()
    # every row greedy: no draw at all
    assert Sampler()(logits, None).tolist() == logits.argmax(-1).tolist()
