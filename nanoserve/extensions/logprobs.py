"""Logprobs: each output token's log-probability, and the k likeliest tokens'.

`SamplingParams(logprobs=k)` reports, per output token, the log-probability of the
sampled token and of the k likeliest, vLLM's way (from the model's logits, before temperature
and top-k/p).

They are computed in the sampling pass, on the device, for the rows that asked, and copied to
the host without waiting; the step's postprocessing turns them into one {token id: logprob} dict
per token in `Sequence.logprobs`. An Extension: after_sample computes them, on_tokens appends
them once the step's tokens are recorded.
"""
from torch import Tensor

from nanoserve.model_runner import Extension, StepOutput
from nanoserve.scheduler import Batch
from nanoserve.sequence import Sequence


class Logprobs(Extension):
    def after_sample(self, logits: Tensor, token_ids: Tensor, seqs: list[Sequence],
                     out: StepOutput) -> None:
        """Log-probabilities of the sampled tokens (S,) and the top k ids and values (S, k),
        into out.extras["logprobs"] as host copies in flight."""
        ks = [seq.params.logprobs for seq in seqs]
        if all(k is None for k in ks):  # no row asked: no cost at all
            return
        logprobs = logits.float().log_softmax(-1)  # (S, V)
        chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1)  # (S,)
        top = logprobs.topk(max(filter(None, ks), default=0), -1)  # (S, k) each; k=0: sampled only
        out.extras["logprobs"] = tuple(t.to("cpu", non_blocking=True)
                                       for t in (chosen, top.indices, top.values))

    def on_tokens(self, batch: Batch, out: StepOutput, token_ids: list[int]) -> list[Sequence]:
        """Append a {token: logprob} dict to each sequence that asked and got a token now (not a
        prefill chunk short of the prompt's end, nor one finished before the step)."""
        if "logprobs" not in out.extras:  # no row asked
            return []
        chosen, ids, values = (t.tolist() for t in out.extras["logprobs"])
        for i, (seq, token) in enumerate(zip(batch.seqs, token_ids)):
            if (k := seq.params.logprobs) is not None and len(seq.logprobs) < seq.num_output_tokens:
                seq.logprobs.append({token: chosen[i]} | dict(zip(ids[i][:k], values[i][:k])))
        return []

