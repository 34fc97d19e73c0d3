"""The sampler alone: greedy rows, the Gumbel race's draw from softmax(logits / T), top-k and top-p
masks, keys that decide a row's draw whatever the other rows, and the noise: a hash of (key, token)
with uniform values. kernels.sampling runs on the CPU; the `gpu` tests run it on CUDA as the engine
does (compiled by extensions.fused) and check it against the CPU and the plain function."""
import pytest
import torch

from nanoserve.extensions import fused
from nanoserve.extensions.top_k_top_p import mask_top_k_top_p
from nanoserve.kernels import sampling

ROWS = 20000
LOGITS = torch.tensor([0.0, 1.0, 2.0, -1.0])
QWEN_VOCAB = 151_936

gpu = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICES = ["cpu", pytest.param("cuda", marks=[gpu, requires_cuda])]
compiled_sample = fused.compiled_steps()["sample"]  # as the fused backends compile it


def draw(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """The engine's draw: on CUDA the fused extension's compiled sampler, on the CPU the core's."""
    return (compiled_sample if logits.is_cuda else sampling.sample)(logits, temps, keys)


def sample(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor,
           top_ks: torch.Tensor | None = None, top_ps: torch.Tensor | None = None) -> torch.Tensor:
    """The model runner's sampling: the top-k/top-p extension's mask (where asked), the draw."""
    if top_ks is not None or top_ps is not None:
        S = logits.shape[0]
        zeros = torch.zeros(S, dtype=torch.long, device=logits.device)
        top_ks = zeros if top_ks is None else top_ks
        top_ps = torch.ones(S, device=logits.device) if top_ps is None else top_ps
        logits = mask_top_k_top_p(logits, temps, top_ks, top_ps)
    return draw(logits, temps, keys)


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
def test_draws_match_softmax_over_a_long_tail(device):
    # a few likely tokens, the last one included, over a tail of 500 unlikely ones
    logits = torch.randn(503, generator=torch.Generator().manual_seed(1))
    logits[[5, 300, 502]] += 6
    expected = torch.softmax(logits / 0.8, -1)
    torch.testing.assert_close(frequencies(logits, 0.8, device, rows=50_000), expected,
                               atol=0.008, rtol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_a_key_draws_the_same_token_in_any_batch(device):
    """A row's draw depends on its logits, temperature and key only: not on the other rows, nor
    on its place in the batch or the batch's size, nor on last-bit changes of the logits away from
    near-ties."""
    gen = torch.Generator().manual_seed(3)
    logits = (torch.randn(8, 1000, generator=gen) * 2).to(device)
    temps = torch.tensor([1.0, 0.7, 1.3, 1.0, 0.9, 1.0, 2.0, 1.0], device=device)
    keys = torch.randint(0, 2**62, (8,), generator=gen).to(device)
    alone = torch.cat([draw(logits[i:i + 1], temps[i:i + 1], keys[i:i + 1]) for i in range(8)])
    order = torch.randperm(8, generator=gen).to(device)
    assert torch.equal(draw(logits[order], temps[order], keys[order]), alone[order])
    assert torch.equal(draw(logits[:3], temps[:3], keys[:3]), alone[:3])
    assert torch.equal(draw(logits.repeat(5, 1), temps.repeat(5), keys.repeat(5)), alone.repeat(5))
    nudged = logits * (1 + 1e-6 * torch.randn(logits.shape, generator=gen).to(device))
    assert torch.equal(draw(nudged, temps, keys), alone)
    other_keys = draw(logits.repeat(8, 1), temps.repeat(8), torch.arange(64, device=device))
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
    logits = torch.randn(8, 1001, device=device)
    logits[0, 904] = logits[0, 5] = 10.0  # a tie: the first index wins, as argmax
    temps = torch.tensor([0.0, 1.0] * 4, device=device)
    keys = torch.randint(0, 2**62, (8,), device=device)
    for masks in ({}, {"top_ks": torch.full((8,), 3, device=device)},
                  {"top_ps": torch.full((8,), 0.9, device=device)}):
        out = sample(logits, temps, keys, **masks)
        assert out[::2].tolist() == logits.argmax(-1)[::2].tolist()


def lowbias32(x: int) -> int:
    """The published lowbias32 on Python's unbounded ints."""
    x = ((x ^ (x >> 16)) * 0x7FEB352D) & 0xFFFFFFFF
    x = ((x ^ (x >> 15)) * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def unlowbias32(x: int) -> int:
    """lowbias32's inverse: the xorshifts undone, the multipliers' inverses mod 2**32."""
    x ^= x >> 16
    x = (x * pow(0x846CA68B, -1, 2**32)) & 0xFFFFFFFF
    x ^= (x >> 15) ^ (x >> 30)
    x = (x * pow(0x7FEB352D, -1, 2**32)) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_keys_with_neighbouring_row_words_share_no_noise():
    """A key below 2**32 has the row word lowbias32(key) (lowbias32(0) = 0 for its high half).
    Two keys whose row words differ in the last bit: with the row word only before the token's
    round, each would get the other's noise with its tokens swapped in pairs."""
    a, b = unlowbias32(12345), unlowbias32(12345 ^ 1)
    assert lowbias32(a) == 12345 and lowbias32(b) == 12345 ^ 1
    u = sampling.uniform(torch.tensor([a, b]), 1024)
    assert len(set(u[0].tolist()) & set(u[1].tolist())) < 8  # by chance: 0.125 expected


def test_the_noise_is_a_hash_of_key_and_token():
    words = [0, 1, 2, 12345, 2**31 - 1, 2**31, 2**32 - 1]
    mixed = sampling.mix32(torch.tensor(words).int())  # int32 words: 2**31 and up wrap negative
    assert (mixed.long() & 0xFFFFFFFF).tolist() == [lowbias32(x) for x in words]
    keys = torch.tensor([0, 1, 2**32, 2**62 + 17, 2**63 - 1])
    u = sampling.uniform(keys, 1000)  # (5, 1000)
    for i, key in enumerate(keys.tolist()):  # the noise as the module docstring defines it
        row = lowbias32(lowbias32(key >> 32) ^ (key & 0xFFFFFFFF))
        for j in (0, 1, 999):
            assert u[i, j] == ((lowbias32(lowbias32(row ^ j) ^ row) >> 9) + 0.5) * 2**-23
    assert u.dtype == torch.float32 and 0 < u.min() and u.max() < 1
    # token j's noise depends on the key and j alone: not on the vocabulary, batch or place
    assert torch.equal(sampling.uniform(keys, 300), u[:, :300])
    assert torch.equal(sampling.uniform(keys.flip(0), 1000), u.flip(0))
    assert len(set(u.flatten().tolist())) > 0.99 * u.numel()  # both halves of the key count


def test_the_noise_is_uniform_and_neighbouring_keys_unrelated():
    u = sampling.uniform(torch.arange(1024), 1024)  # (keys, tokens): neighbours in both
    counts = torch.histc(u, bins=64, min=0, max=1)
    expected = u.numel() / 64
    chi2 = ((counts - expected) ** 2 / expected).sum()
    assert chi2 < 131  # 63 degrees of freedom: a uniform stays below 131 but once in 10**6
    for a, b in ((u[1:], u[:-1]), (u[:, 1:], u[:, :-1])):  # neighbouring keys, tokens
        r = torch.corrcoef(torch.stack([a.flatten(), b.flatten()]))[0, 1]
        assert abs(r) < 0.005  # 1M pairs: independent ones correlate within +-0.001 (1 sd)
    means = u.mean(1)  # per key: 1024 uniforms, mean 0.5 +- 0.009 (1 sd)
    assert (means - 0.5).abs().max() < 0.05


@gpu
@requires_cuda
@pytest.mark.parametrize("S", [1, 7, 64])
def test_cpu_and_cuda_draw_the_same_tokens(S):
    """The same bits of noise on both devices, plain or compiled; the same tokens but at
    near-ties of the float math (logarithms may round differently)."""
    gen = torch.Generator().manual_seed(S)
    logits = (torch.randn(S, QWEN_VOCAB, generator=gen) * 3).bfloat16()
    temps = torch.rand(S, generator=gen) + 0.3
    temps[::5] = 0  # greedy rows among them
    keys = torch.randint(0, 2**63 - 1, (S,), generator=gen)
    noise = sampling.uniform(keys, QWEN_VOCAB)
    assert torch.equal(sampling.uniform(keys.cuda(), QWEN_VOCAB).cpu(), noise)
    assert torch.equal(fused.gpu_compiled(sampling.uniform)(keys.cuda(), QWEN_VOCAB).cpu(), noise)
    cpu = sampling.sample(logits, temps, keys)
    for got in (sampling.sample(logits.cuda(), temps.cuda(), keys.cuda()),
                draw(logits.cuda(), temps.cuda(), keys.cuda())):
        assert (got.cpu() != cpu).sum() <= S // 32  # near-ties only: a row in 32 at most


@gpu
@requires_cuda
def test_compiled_sampler_equals_the_plain_one():
    """the compiled sampler (torch.compile, one kernel for every batch size above 1) against
    kernels.sampling.sample on the same CUDA tensors."""
    gen = torch.Generator().manual_seed(4)
    for S in (1, 2, 33, 256):
        logits = (torch.randn(S, 32_000, generator=gen) * 3).cuda()
        temps = (torch.rand(S, generator=gen) + 0.3).cuda()
        temps[::3] = 0
        keys = torch.randint(0, 2**63 - 1, (S,), generator=gen).cuda()
        compiled = compiled_sample(logits, temps, keys)
        plain = sampling.sample(logits, temps, keys)
        assert compiled.dtype == torch.int64 and compiled.shape == (S,)
        assert (compiled != plain).sum() <= S // 32  # near-ties only
