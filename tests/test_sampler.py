"""The sampler alone: greedy rows, the exponential race draws from softmax(logits / T), top-k and top-p masks.
The race's noise is either given (seeded rows) or drawn inside the sampling pass; on a GPU that pass is the
torch.compile'd kernel (the `gpu` tests), on the CPU eager torch."""
import pytest
import torch

from nanoserve.layers import Sampler

ROWS = 20000
LOGITS = torch.tensor([0.0, 1.0, 2.0, -1.0])
DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def draw(temperature: float, device: str = "cpu", given_noise: bool = True, **masks) -> torch.Tensor:
    torch.manual_seed(0)
    logits = LOGITS.repeat(ROWS, 1).to(device)  # (S, V): the same distribution in every row
    temps = torch.full((ROWS,), temperature, device=device)
    masks = {k: torch.full((ROWS,), v, device=device) for k, v in masks.items()}
    noise = torch.empty(logits.shape, device=device).exponential_() if given_noise else None
    out = Sampler()(logits, temps, noise, **masks)
    return (torch.bincount(out, minlength=4) / ROWS).cpu()  # empirical frequency of each token


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("given_noise", [True, False])
def test_race_matches_softmax_with_temperature(device, given_noise):
    for t in (0.5, 1.0, 2.0):
        torch.testing.assert_close(draw(t, device, given_noise), torch.softmax(LOGITS / t, -1), atol=0.015, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_top_k_keeps_the_k_most_likely(device):
    p = torch.softmax(LOGITS / 0.7, -1)
    expected = torch.tensor([0.0, p[1], p[2], 0.0]) / (p[1] + p[2])
    torch.testing.assert_close(draw(0.7, device, False, top_ks=2), expected, atol=0.015, rtol=0)


def test_top_p_keeps_the_smallest_set_reaching_p():
    p = torch.softmax(LOGITS, -1)  # [0.087, 0.237, 0.644, 0.032]
    assert draw(1.0, top_ps=0.5).tolist() == [0.0, 0.0, 1.0, 0.0]  # the top token alone reaches 0.5
    kept = torch.tensor([0.0, p[1], p[2], 0.0]) / (p[1] + p[2])  # 0.644 < 0.8 <= 0.644 + 0.237
    torch.testing.assert_close(draw(1.0, top_ps=0.8), kept, atol=0.015, rtol=0)


def test_greedy_rows_ignore_noise_and_masks():
    logits = torch.randn(8, 50)
    temps = torch.tensor([0.0, 1.0] * 4)
    noise = torch.empty(8, 50).exponential_()
    for masks in ({}, {"top_ks": torch.full((8,), 3)}, {"top_ps": torch.full((8,), 0.9)}):
        out = Sampler()(logits, temps, noise, **masks)
        assert out[::2].tolist() == logits.argmax(-1)[::2].tolist()
    assert Sampler()(logits, torch.zeros(8), None).tolist() == logits.argmax(-1).tolist()  # noise drawn inside
    assert Sampler()(logits, None).tolist() == logits.argmax(-1).tolist()  # every row greedy: no draw at all
