"""Logprobs: each output token's log-probability, and the k likeliest tokens'.

`SamplingParams(logprobs=k)` reports, per output token, the log-probability of the
sampled token and of the k likeliest, vLLM's way (from the model's logits, before temperature
and top-k/p).

They are computed in the sampling pass, on the device, for the rows that asked, and copied to
the host without waiting; the step's postprocessing turns them into one {token id: logprob} dict
per token in `Sequence.logprobs`. An Extension: after_sample computes them, on_tokens (before
the tokens are recorded) appends them.
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

    def on_tokens(self, batch: Batch, out: StepOutput, token_ids: list[int]) -> None:
        """Append a {token: logprob} dict to each sequence that asked and gets a token now."""
        if "logprobs" not in out.extras:
            return
        chosen, ids, values = (t.tolist() for t in out.extras["logprobs"])
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            k = seq.params.logprobs
            # a prefill chunk that does not end the prompt samples nothing
            if k is None or seq.is_finished or seq.num_computed_tokens + num_new < seq.num_tokens:
                continue
            seq.logprobs.append({token_ids[i]: chosen[i]} | dict(zip(ids[i][:k], values[i][:k])))

