"""The sampler alone: greedy rows, the Gumbel race's draw from softmax(logits / T), top-k and top-p
masks, and keys that decide a row's draw whatever the other rows. On a GPU the draw is the Triton
kernels of extensions/race_sampler.py (the `gpu` tests), on the CPU the core's kernels.sample
(torch's own noise). Chunks are cut to 16 logits here, so small vocabularies span several chunks
on the GPU."""
import pytest
import torch

from nanoserve.extensions import race_sampler
from nanoserve.extensions.top_k_top_p import mask_top_k_top_p
from nanoserve.layers import Sampler

SAMPLE_CHUNK = 16

ROWS = 20000
LOGITS = torch.tensor([0.0, 1.0, 2.0, -1.0])


@pytest.fixture(autouse=True)
def small_chunks(monkeypatch):
    monkeypatch.setattr(race_sampler, "SAMPLE_CHUNK", SAMPLE_CHUNK)


DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU")])]


def sample(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor,
           top_ks: torch.Tensor | None = None, top_ps: torch.Tensor | None = None) -> torch.Tensor:
    """The model runner's sampling: the top-k/top-p extension's mask (where asked), then Sampler."""
    if top_ks is not None or top_ps is not None:
        S = logits.shape[0]
        zeros = torch.zeros(S, dtype=torch.long, device=logits.device)
        top_ks = zeros if top_ks is None else top_ks
        top_ps = torch.ones(S, device=logits.device) if top_ps is None else top_ps
        logits = mask_top_k_top_p(logits, temps, top_ks, top_ps)
    if logits.is_cuda:  # the race sampler's kernels, which the engine runs on the GPU
        return race_sampler.sample(logits, temps, keys)
    return Sampler()(logits, temps, keys)


def frequencies(logits: torch.Tensor, temperature: float, device: str = "cpu", rows: int = ROWS,
                **masks) -> torch.Tensor:
    """Empirical frequency of each token over `rows` draws from the same logits (V,)."""
    torch.manual_seed(0)
    temps = torch.full((rows,), temperature, device=device)
    masks = {k: torch.full((rows,), v, device=device) for k, v in masks.items()}
    keys = torch.randint(0, 2**62, (rows,), device=device)
    out = sample(logits.repeat(rows, 1).to(device), temps, keys, **masks)
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


@pytest.mark.parametrize("device", DEVICES)
def test_a_key_draws_the_same_token_in_any_batch(device):
    """A row's draw depends on its logits, temperature and key only: not on the other rows, nor
    on its place in the batch, nor on last-bit changes of the logits away from near-ties."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(8, 3 * SAMPLE_CHUNK + 5, generator=gen) * 2).to(device)
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.9, 1.0, 2.0, 1.0], device=device)
    keys = torch.randint(0, 2**62, (8,), generator=gen).to(device)
    alone = torch.cat([Sampler()(logits[i:i + 1], temps[i:i + 1], keys[i:i + 1])
                       for i in range(8)])
    order = torch.randperm(8, generator=gen).to(device)
    shuffled = Sampler()(logits[order], temps[order], keys[order])
    assert torch.equal(shuffled, alone[order])
    nudged = logits * (1 + 1e-6 * torch.randn(logits.shape, generator=gen).to(device))
    assert torch.equal(Sampler()(nudged, temps, keys), alone)
    other_keys = Sampler()(logits.repeat(8, 1), temps.repeat(8), torch.arange(64, device=device))
    assert len(set(other_keys.tolist())) > 8  # other keys: other draws


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
    keys = torch.randint(0, 2**62, (8,), device=device)
    for masks in ({}, {"top_ks": torch.full((8,), 3, device=device)},
                  {"top_ps": torch.full((8,), 0.9, device=device)}):
        out = sample(logits, temps, keys, **masks)
        assert out[::2].tolist() == logits.argmax(-1)[::2].tolist()
    # every row greedy: no draw at all
    assert Sampler()(logits, None).tolist() == logits.argmax(-1).tolist()
