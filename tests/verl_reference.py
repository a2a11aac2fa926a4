"""verl's actor loss as the reference for dtree's verl names: verl's own code
(``verl.workers.utils.losses.ppo_loss``, ``verl.trainer.ppo.core_algos``) when verl is
installed (CI's oldest-transformers stage, ``dtree[verl]``), and otherwise a written
copy of what verl 0.9.1 computes (the main stage has no verl: transformers there is
newer than verl allows). ``test_losses_verl.py`` checks the written copy against verl's
code whenever verl is installed, so the fallback cannot drift from it.

The batch is laid out as verl's trainer hands it to the actor's loss: ``prompts``
left-padded, ``responses`` right-padded, ``attention_mask`` over both, response fields
``[S, R]`` (``response_mask``, ``old_log_probs``, ``advantages``, ``ref_log_prob``), and
the model's log-probs as a nested tensor over every row's tokens, entry ``t`` being
``log p(token t+1)`` (what verl's FSDP engine returns).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

try:  # verl imports ray, tensordict, hydra, ...: present in the dtree[verl] environment only
    from tensordict import TensorDict
    from verl.trainer.ppo import core_algos as verl_core
    from verl.utils import tensordict_utils as verl_tu
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss as verl_ppo_loss

    HAVE_VERL = True
except ImportError:  # the written copy below is the reference
    HAVE_VERL = False


@dataclass
class VerlSettings:
    """The ``actor`` settings the loss reads (verl's ``ActorConfig`` field names)."""

    loss_mode: str = "vanilla"
    loss_agg_mode: str = "token-mean"
    clip_ratio: float = 0.2
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.28
    clip_ratio_c: float = 3.0
    tau_pos: float = 1.0
    tau_neg: float = 1.05
    entropy_coeff: float = 0.0
    use_kl_loss: bool = False
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    loss_scale_factor: float | None = None
    extra: dict = field(default_factory=dict)

    @property
    def policy_loss(self) -> dict:
        return {"loss_mode": self.loss_mode}

    def config(self, rows: int):
        """verl's own config when verl is installed, else these settings (same field names)."""
        return self.actor_config(rows) if HAVE_VERL else self

    def actor_config(self, rows: int):
        """verl's FSDPActorConfig with these settings (needs verl)."""
        cfg = FSDPActorConfig(
            strategy="fsdp", rollout_n=1, ppo_mini_batch_size=rows, ppo_micro_batch_size_per_gpu=rows,
            clip_ratio=self.clip_ratio, clip_ratio_low=self.clip_ratio_low, clip_ratio_high=self.clip_ratio_high,
            clip_ratio_c=self.clip_ratio_c, loss_agg_mode=self.loss_agg_mode, loss_scale_factor=self.loss_scale_factor,
            entropy_coeff=self.entropy_coeff, tau_pos=self.tau_pos, tau_neg=self.tau_neg,
            use_kl_loss=self.use_kl_loss, kl_loss_coef=self.kl_loss_coef, kl_loss_type=self.kl_loss_type,
            calculate_entropy=self.entropy_coeff != 0, policy_loss=PolicyLossConfig(loss_mode=self.loss_mode),
            **self.extra,
        )
        return cfg


@dataclass
class ResponseBatch:
    """A padded batch in verl's layout (see the module docstring)."""

    prompts: torch.Tensor  # [S, P] left-padded
    responses: torch.Tensor  # [S, R] right-padded
    attention_mask: torch.Tensor  # [S, P + R]
    response_mask: torch.Tensor  # [S, R]
    fields: dict[str, torch.Tensor]  # name -> [S, R], verl's names
    rows: list[list[int]]  # each row's real tokens

    @property
    def prompt_lens(self) -> list[int]:
        return self.attention_mask[:, : self.prompts.shape[1]].sum(1).tolist()


def response_batch(seqs, prompt_lens, fields, dtype=torch.float32) -> ResponseBatch:
    """``seqs[s]`` split at ``prompt_lens[s]``; ``fields``: name -> per sequence, per token
    (dtree's alignment: value ``t`` belongs to the prediction of token ``t``), with keys
    ``loss_mask``, ``advantages``, ``old_logprobs``, ``ref_logprobs``."""
    S, P = len(seqs), max(prompt_lens)
    R = max(len(s) - p for s, p in zip(seqs, prompt_lens))
    prompts, responses = torch.zeros(S, P, dtype=torch.long), torch.zeros(S, R, dtype=torch.long)
    attn = torch.zeros(S, P + R, dtype=torch.long)
    names = {"loss_mask": "response_mask", "advantages": "advantages", "old_logprobs": "old_log_probs",
             "ref_logprobs": "ref_log_prob"}
    out = {v: torch.zeros(S, R, dtype=dtype) for k, v in names.items() if k in fields}
    for s, (seq, p) in enumerate(zip(seqs, prompt_lens)):
        r = len(seq) - p
        prompts[s, P - p :] = torch.tensor(seq[:p])
        responses[s, :r] = torch.tensor(seq[p:])
        attn[s, P - p : P + r] = 1
        for k, v in names.items():
            if k in fields:
                out[v][s, :r] = torch.as_tensor(fields[k][s], dtype=dtype)[p:]
    mask = out.pop("response_mask")
    return ResponseBatch(prompts, responses, attn, mask, out, [list(s) for s in seqs])


def nested_logprobs(per_row: list[torch.Tensor]) -> torch.Tensor:
    """verl's model output layout from per-row [len-1] log-probs (differentiable): a
    nested [S, len] tensor, entry ``t`` = ``log p(token t+1)``, the last entry 0."""
    values = torch.cat([torch.cat([lp, lp.new_zeros(1)]) for lp in per_row])
    lengths = torch.tensor([len(lp) + 1 for lp in per_row])
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    return torch.nested.nested_tensor_from_jagged(values, offsets)


def response_values(per_row: list[torch.Tensor], batch: ResponseBatch) -> torch.Tensor:
    """[S, R] each row's response log-probs (from [len-1] per row), 0 at padding."""
    R = batch.responses.shape[1]
    out = []
    for lp, p in zip(per_row, batch.prompt_lens):
        resp = lp[p - 1 :]
        out.append(torch.cat([resp, resp.new_zeros(R - len(resp))]))
    return torch.stack(out)


def verl_loss(settings: VerlSettings, batch: ResponseBatch, logprobs, entropy=None, *, global_batch_size=None,
              batch_num_tokens=None, dp_size=1, written=False) -> torch.Tensor:
    """The actor loss verl's trainer computes on ``batch`` (``global_batch_size``: every
    row by default, as verl's trainer passes it; ``batch_num_tokens``: the batch's loss
    tokens). ``logprobs``/``entropy``: per row [len-1]. ``written``: the written copy even
    when verl is installed."""
    S = len(batch.rows)
    gbs = S if global_batch_size is None else global_batch_size
    tokens = int(batch.response_mask.sum()) if batch_num_tokens is None else batch_num_tokens
    if HAVE_VERL and not written:
        data = {"prompts": batch.prompts, "responses": batch.responses, "attention_mask": batch.attention_mask,
                "response_mask": batch.response_mask, **batch.fields}
        td = TensorDict(data, batch_size=[S])
        verl_tu.assign_non_tensor(td, dp_size=dp_size, batch_num_tokens=tokens, global_batch_size=gbs)
        out = {"log_probs": nested_logprobs(logprobs)}
        if entropy is not None:
            out["entropy"] = nested_logprobs(entropy)
        loss, _ = verl_ppo_loss(settings.actor_config(S), out, td)
        return loss
    lp = response_values(logprobs, batch)
    ent = None if entropy is None else response_values(entropy, batch)
    return written_ppo_loss(settings, batch, lp, ent, gbs, tokens, dp_size)


def agg_loss(mat, mask, mode, **counts):
    """verl's ``core_algos.agg_loss`` (its written copy without verl)."""
    return verl_core.agg_loss(mat, mask, mode, **counts) if HAVE_VERL else written_agg_loss(mat, mask, mode, **counts)


def kl_penalty(lp, ref, name):
    """verl's ``core_algos.kl_penalty`` (its written copy without verl)."""
    return verl_core.kl_penalty(lp, ref, name) if HAVE_VERL else written_kl_penalty(lp, ref, name)


# ---------------------------------------------------------------------- the written copy of verl 0.9.1
def written_agg_loss(mat, mask, mode, dp_size=1, batch_num_tokens=None, global_batch_size=None,
                     loss_scale_factor=None):
    """core_algos.agg_loss of verl 0.9.1."""
    if mode == "token-mean":
        tokens = mask.sum() if batch_num_tokens is None else batch_num_tokens
        return (mat * mask).sum() / tokens * dp_size
    if mode == "token-sum":
        return (mat * mask).sum() * dp_size
    seq_tokens = mask.sum(-1)
    has = (seq_tokens > 0).float()
    rows = has.sum() if global_batch_size is None else global_batch_size
    if mode == "seq-mean-token-mean":
        seq = (mat * mask).sum(-1) / (seq_tokens + 1e-8)
        return (seq * has).sum() / rows * dp_size
    if mode in ("seq-mean-token-sum", "seq-mean-token-sum-norm"):
        loss = ((mat * mask).sum(-1) * has).sum() / rows * dp_size
        if mode == "seq-mean-token-sum-norm":
            loss = loss / (mask.shape[-1] if loss_scale_factor is None else loss_scale_factor)
        return loss
    raise ValueError(mode)


def written_kl_penalty(lp, ref, name):
    """core_algos.kl_penalty of verl 0.9.1 (its "k3" is the clamped low_var_kl)."""
    base = name[:-1] if name.endswith("+") else name
    d = lp - ref
    if base in ("kl", "k1"):
        value = d
    elif base == "abs":
        value = d.abs()
    elif base in ("mse", "k2"):
        value = 0.5 * d.square()
    elif base in ("low_var_kl", "k3"):
        kl = torch.clamp(-d, min=-20, max=20)
        value = torch.clamp(torch.exp(kl) - kl - 1, min=-10, max=10)
    else:
        raise NotImplementedError(name)
    if not name.endswith("+") or name in ("mse", "k2"):
        return value
    back = 0.5 * d.square()
    return back - back.detach() + value.detach()


def written_policy_terms(st: VerlSettings, lp, old, adv, mask):
    """[S, R] per-token policy loss of verl 0.9.1's ``loss_mode``, and the aggregation
    verl applies to it."""
    lo, hi = st.clip_ratio_low, st.clip_ratio_high
    if st.loss_mode == "gspo":
        seq = ((lp - old) * mask).sum(-1) / mask.sum(-1).clamp(min=1)
        log_r = torch.clamp(lp - lp.detach() + seq.detach().unsqueeze(-1), max=10.0)
        r = torch.exp(log_r)
        return torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - lo, 1 + hi)), st.loss_agg_mode
    if st.loss_mode == "gpg":
        return -lp * adv, st.loss_agg_mode
    r = torch.exp(torch.clamp(lp - old, -20.0, 20.0))
    if st.loss_mode == "vanilla":
        clip1 = torch.maximum(-adv * r, -adv * torch.clamp(r, 1 - lo, 1 + hi))
        return torch.where(adv < 0, torch.minimum(-adv * st.clip_ratio_c, clip1), clip1), st.loss_agg_mode
    if st.loss_mode == "cispo":
        return -torch.clamp(r, 1 - lo, 1 + hi).detach() * adv * lp, st.loss_agg_mode
    if st.loss_mode == "sapo":
        tau = torch.where(adv > 0, st.tau_pos, st.tau_neg)
        return -torch.sigmoid(tau * (r - 1.0)) * (4.0 / tau) * adv, "seq-mean-token-mean"
    raise ValueError(st.loss_mode)


def written_ppo_loss(st: VerlSettings, batch: ResponseBatch, lp, ent, gbs, tokens, dp_size):
    """verl.workers.utils.losses.ppo_loss of verl 0.9.1 on [S, R] response tensors."""
    mask = batch.response_mask
    info = dict(dp_size=dp_size, batch_num_tokens=tokens, global_batch_size=gbs, loss_scale_factor=st.loss_scale_factor)
    terms, mode = written_policy_terms(st, lp, batch.fields["old_log_probs"], batch.fields["advantages"], mask)
    loss = written_agg_loss(terms, mask, mode, **info)
    if ent is not None:
        loss = loss - st.entropy_coeff * written_agg_loss(ent, mask, st.loss_agg_mode, **info)
    if st.use_kl_loss:
        kl = written_kl_penalty(lp, batch.fields["ref_log_prob"], st.kl_loss_type)
        loss = loss + st.kl_loss_coef * written_agg_loss(kl, mask, st.loss_agg_mode, **info)
    return loss
