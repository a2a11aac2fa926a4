"""TreeGRPOTrainer against TRL's own GRPOTrainer: the same training, end to end.

Both trainers run from the same saved tiny model (random weights, fp32, CPU), the same
seed, an offline tokenizer, and the same deterministic rollout (``rollout_func``: both
see identical completions); 3 optimizer steps, then every parameter is compared
(relative error <= 1e-4 against the size of the parameter's total update), and so are
the metrics TRL logs. Configurations cover the loss types, KL (beta), token- and
sequence-level importance sampling, gradient accumulation with several iterations per
generation (so old log-probs are computed), PEFT's disabled-adapter reference,
multi-turn rollouts with a tool mask, the sampling temperature, the entropy bonus, and
the features that fall back to TRL's own path.
"""

from __future__ import annotations

import copy
import os
import tempfile
import warnings
import zlib

import pytest
import torch

os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
trl = pytest.importorskip("trl")
datasets = pytest.importorskip("datasets")
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen2Config  # noqa: E402

from dtree.integrations.trl import TreeGRPOTrainer  # noqa: E402

CHARS = "abcdefghijklmnopqrstuvwxyz0123456789 +=?"
PAD, EOS, TOOL = 0, 1, 3  # TOOL: the token 'a' opens a tool call in the multi-turn rollouts
PROMPTS = ["abc", "hello", "x+y", "qq", "zz9", "what?", "12+3", "m"]
PARAM_TOL = 1e-4


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A character-level tokenizer built offline (no hub)."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": PAD, "<eos>": EOS, "<unk>": 2, **{c: i + 3 for i, c in enumerate(CHARS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    out = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
    out.chat_template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    return out


TOKENIZER = make_tokenizer()


@pytest.fixture(scope="module")
def model_dir():
    return save_tiny_model()


def save_tiny_model() -> str:
    """The tiny model, saved once: both trainers (and TRL's reference model) load it."""
    config = Qwen2Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, tie_word_embeddings=False, rms_norm_eps=1e-6,
        pad_token_id=PAD, eos_token_id=EOS,
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    path = tempfile.mkdtemp(prefix="dtree_trl_model_")
    model.save_pretrained(path)
    return path


class Rollout:
    """A deterministic rollout: completions depend only on the prompt, its row and the
    call count, so two trainers fed the same prompts see the same completions.

    ``multi_turn``: a completion that starts with the tool token gets a tool result
    (masked out of the loss through ``env_mask``) and a second generated turn; rows of
    one prompt share their first turn, so trees have more than one level.
    ``truncate``: some completions end without EOS (``mask_truncated_completions``)."""

    def __init__(self, multi_turn: bool = False, truncate: bool = False, max_new: int = 8):
        self.calls, self.multi_turn, self.truncate, self.max_new = 0, multi_turn, truncate, max_new

    def __call__(self, prompts, trainer):
        self.calls += 1
        out = {"prompt_ids": [], "completion_ids": [], "logprobs": None}
        if self.multi_turn:
            out["env_mask"] = []
        for i, p in enumerate(prompts):
            g = torch.Generator().manual_seed(zlib.crc32(f"{p}|{i}|{self.calls}".encode()))
            n = int(torch.randint(1, self.max_new - 1, (), generator=g))
            ids = torch.randint(3, 3 + len(CHARS), (n,), generator=g).tolist()
            ends = not (self.truncate and i % 3 == 1)
            if self.multi_turn:
                first = [TOOL] + torch.randint(4, 12, (2,), generator=torch.Generator().manual_seed(zlib.crc32(p.encode()))).tolist()
                tool = [20, 21, 22]  # the tool's answer: in the sequence, not in the loss
                ids = first + tool + ids[:3]
                out["env_mask"].append([1] * len(first) + [0] * len(tool) + [1] * (len(ids) - len(first) - len(tool)) + ([1] if ends else []))
            out["prompt_ids"].append(TOKENIZER(p)["input_ids"])
            out["completion_ids"].append(ids + ([EOS] if ends else []))
        return out


def reward(completions, **kwargs):
    """More 'a' and 'b', shorter answers."""
    return [float(c.count("a") + 2 * c.count("b")) - 0.1 * len(c) for c in completions]


def config(**kw):
    base = dict(
        output_dir=tempfile.mkdtemp(prefix="dtree_trl_run_"), per_device_train_batch_size=4, num_generations=4,
        max_completion_length=16, max_steps=3, learning_rate=2e-2, logging_steps=1, report_to=[], use_cpu=True,
        seed=0, gradient_accumulation_steps=2, num_iterations=2, save_strategy="no", disable_tqdm=True,
        dataloader_num_workers=0, bf16=False,  # fp32: GRPOConfig turns on bf16 autocast by default
        # AdamW's step g / (sqrt(v) + eps) is about lr * sign(g) wherever |g| << eps: with the
        # default eps 1e-8, float32 rounding in near-zero gradients becomes lr-sized parameter
        # differences (3e-4 of the update here). A larger eps keeps the comparison about the
        # gradients; test_default_adamw runs TRL's defaults.
        adam_epsilon=1e-4,
    )
    base.update(kw)
    return trl.GRPOConfig(**base)


def train(cls, model, args, rollout=None, **kw):
    """(trainer, {name: parameter after training}, {name: parameter before})."""
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS * 4})
    trainer = cls(model=model, reward_funcs=reward, args=args, train_dataset=ds, processing_class=TOKENIZER,
                  rollout_func=rollout or Rollout(), **kw)
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    trainer.train()
    after = {n: p.detach().clone() for n, p in trainer.model.named_parameters()}
    return trainer, after, before


def compare(model_dir, rollout_kw=None, trainer_kw=None, metric_keys=None, **cfg):
    """Train both trainers; assert parameters and logged metrics agree; return them."""
    rollout_kw, trainer_kw = rollout_kw or {}, trainer_kw or {}
    ref, ref_after, before = train(trl.GRPOTrainer, _model(model_dir, trainer_kw), config(**cfg), Rollout(**rollout_kw),
                                   **_kw(trainer_kw))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)  # no fallback: every step went through dtree
        warnings.filterwarnings("ignore", message=".*(rollout_func|experimental|deprecated).*")
        tree, tree_after, _ = train(TreeGRPOTrainer, _model(model_dir, trainer_kw), config(**cfg), Rollout(**rollout_kw),
                                    **_kw(trainer_kw))
    assert tree._dtree_runtimes, "dtree never ran"
    assert_same_parameters(tree_after, ref_after, before)
    assert_same_logs(tree.state.log_history, ref.state.log_history, metric_keys)
    return tree, ref


def _model(model_dir, trainer_kw):
    """The model argument: the saved path (TRL then builds its reference model from it), or
    a fresh PEFT-wrapped model for the PEFT cases."""
    if trainer_kw.get("peft_config") is None:
        return model_dir
    return AutoModelForCausalLM.from_pretrained(model_dir)


def _kw(trainer_kw):
    return {k: copy.deepcopy(v) for k, v in trainer_kw.items()}


def assert_same_parameters(got: dict, want: dict, before: dict, tol: float = PARAM_TOL) -> None:
    moved = 0
    want = {n: w for n, w in want.items() if not torch.equal(w, before[n]) or not torch.equal(got[n], before[n])}
    for name, w in want.items():
        update = (w - before[name]).norm().item()
        err = (got[name] - w).norm().item()
        scale = max(update, 1e-3 * w.norm().item(), 1e-12)
        assert err <= tol * scale, f"{name}: off by {err:.3e}, update {update:.3e}"
        moved += update > 0
    assert moved >= 4, "training did not move the parameters: the comparison would be empty"


LOGGED = ("loss", "entropy", "kl", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean",
          "clip_ratio/low_min", "clip_ratio/high_max", "cispo_clip_ratio", "policy_loss", "entropy_coef", "reward",
          "grad_norm")


def assert_same_logs(got: list, want: list, keys=None) -> None:
    keys = keys or LOGGED
    assert len(got) == len(want)
    seen = set()
    for g, w in zip(got, want):
        for k in keys:
            if k in w:
                assert k in g, k
                seen.add(k)
                assert g[k] == pytest.approx(w[k], rel=1e-4, abs=2e-6), (k, g[k], w[k])
    assert {"loss", "entropy", "grad_norm"} <= seen, seen


# ---------------------------------------------------------------------- the required combinations
@pytest.mark.parametrize("level", ["token", "sequence"])
@pytest.mark.parametrize("beta", [0.0, 0.04])
@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo", "dapo"])
def test_same_training_as_grpo_trainer(model_dir, loss_type, beta, level):
    """Gradient accumulation 2, num_iterations 2: old log-probs are computed (by dtree in
    the tree trainer), and a GRPO group is split across micro-batches by TRL's shuffle."""
    tree, _ = compare(model_dir, loss_type=loss_type, beta=beta, importance_sampling_level=level, epsilon_high=0.28)
    clip = [h["clip_ratio/region_mean"] for h in tree.state.log_history if "clip_ratio/region_mean" in h]
    assert max(clip) > 0, "the data never clipped: the clip branch would be untested"
    if beta:
        assert any(h.get("kl", 0) > 0 for h in tree.state.log_history)


@pytest.mark.parametrize("loss_type,level", [("grpo", "token"), ("dapo", "sequence")])
def test_on_policy_single_pass(model_dir, loss_type, level):
    """One iteration, no accumulation: GRPOTrainer computes no old log-probs and uses the
    current ones, detached; the tree trainer does the same inside its one pass."""
    compare(model_dir, loss_type=loss_type, beta=0.04, importance_sampling_level=level, gradient_accumulation_steps=1,
            num_iterations=1, max_steps=3)


@pytest.mark.parametrize("loss_type", ["cispo", "sapo", "luspo"])
def test_other_loss_types(model_dir, loss_type):
    kw = dict(epsilon_high=1.5) if loss_type == "cispo" else {}
    compare(model_dir, loss_type=loss_type, beta=0.04, **kw)


def test_delta_temperature_no_bias_correction_fp32_head(model_dir):
    """cast_lm_head_to_fp32 patches lm_head.forward: dtree then calls the head as a module."""
    compare(model_dir, loss_type="grpo", beta=0.04, delta=1.5, temperature=0.7, use_bias_correction_kl=False,
            cast_lm_head_to_fp32=True)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_entropy_bonus(model_dir, loss_type):
    """TRL's bonus is a token mean over the micro-batch whatever the loss type's own
    normalization: dtree folds it in per token (entropy_scale)."""
    tree, _ = compare(model_dir, loss_type=loss_type, entropy_coef=0.02)
    assert any("policy_loss" in h for h in tree.state.log_history)


def test_multi_turn_tool_mask_and_truncation(model_dir):
    """Tool results (env_mask 0) stay in the sequences but out of the loss; rows of one
    prompt share their first turn and tool call (deeper trees); truncated completions are
    masked whole."""
    compare(model_dir, rollout_kw=dict(multi_turn=True, truncate=True), loss_type="grpo", beta=0.04,
            mask_truncated_completions=True)


def test_peft_disabled_adapter_reference(model_dir):
    """LoRA: the reference log-probs are the base model's (adapter disabled), computed by
    dtree on the same module inside TRL's context."""
    peft = pytest.importorskip("peft")
    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"], lora_dropout=0.0,
                           init_lora_weights=False)
    compare(model_dir, trainer_kw=dict(peft_config=lora), loss_type="bnpo", beta=0.1, learning_rate=5e-2)


def test_gradient_checkpointing_maps_to_recompute(model_dir):
    tree, _ = compare(model_dir, loss_type="grpo", gradient_checkpointing=True)
    assert all(rt.mode == "recompute" for _, rt in tree._dtree_runtimes.values())


# ---------------------------------------------------------------------- fallbacks
def test_fallback_warns_once_and_trains_like_trl(model_dir):
    """A feature the tree does not map (the entropy-quantile mask) runs GRPOTrainer's own
    loss, with one warning naming it: the result is TRL's."""
    cfg = dict(loss_type="grpo", top_entropy_quantile=0.5)
    ref, ref_after, before = train(trl.GRPOTrainer, model_dir, config(**cfg))
    with pytest.warns(UserWarning, match="entropy-quantile mask") as record:
        tree, tree_after, _ = train(TreeGRPOTrainer, model_dir, config(**cfg))
    assert sum("entropy-quantile" in str(w.message) for w in record) == 1
    assert_same_parameters(tree_after, ref_after, before)


def test_fallback_reasons(model_dir):
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})
    cases = {
        "vespo": dict(loss_type="vespo"),
        "importance_sampling_level='sequence' with loss_type='cispo'": dict(loss_type="cispo", importance_sampling_level="sequence"),
        "off-policy sequence mask": dict(off_policy_mask_threshold=0.5),
        "adaptive entropy": dict(use_adaptive_entropy=True),
        "entropy bonus with importance_sampling_level": dict(entropy_coef=0.01, importance_sampling_level="sequence"),
    }
    for reason, cfg in cases.items():
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            trainer = TreeGRPOTrainer(model=model_dir, reward_funcs=reward, args=config(**cfg), train_dataset=ds,
                                      processing_class=TOKENIZER, rollout_func=Rollout())
        got = trainer._fallback_reason(trainer.model, training=True, inputs={})
        assert got is not None and reason in got, (reason, got)
        assert trainer._fallback_reason(trainer.model, training=True, inputs={"pixel_values": torch.zeros(1)}) == \
            "vision/multimodal inputs"
    trainer = TreeGRPOTrainer(model=model_dir, reward_funcs=reward, args=config(), train_dataset=ds,
                              processing_class=TOKENIZER, rollout_func=Rollout())
    assert trainer._fallback_reason(trainer.model, training=True, inputs={}) is None
    trainer.model.train()
    trainer.model.config.attention_dropout = 0.1
    for layer in trainer.model.model.layers:
        layer.self_attn.attention_dropout = 0.1
    assert "attention dropout" in trainer._fallback_reason(trainer.model, training=True, inputs={})


def test_old_and_ref_logprobs_equal_trl(model_dir):
    """The log-prob override alone: dtree's values equal TRL's fused head on a padded batch
    with left-padded prompts of different lengths (RoPE positions differ, values do not)."""
    ds = datasets.Dataset.from_dict({"prompt": PROMPTS})
    trainer = TreeGRPOTrainer(model=model_dir, reward_funcs=reward, args=config(temperature=0.8), train_dataset=ds,
                              processing_class=TOKENIZER, rollout_func=Rollout())
    prompts = [TOKENIZER(p)["input_ids"] for p in ("abc", "hello", "m", "x+y")]
    completions = [[5, 6, 7, EOS], [8, EOS], [9, 10, 11, 12, 13], [EOS]]
    P, R = max(map(len, prompts)), max(map(len, completions))
    ids = torch.tensor([[PAD] * (P - len(p)) + p + c + [PAD] * (R - len(c)) for p, c in zip(prompts, completions)])
    mask = torch.tensor([[0] * (P - len(p)) + [1] * (len(p) + len(c)) + [0] * (R - len(c)) for p, c in zip(prompts, completions)])
    with torch.no_grad():
        got_lp, got_ent, _ = trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, R, compute_entropy=True)
        want_lp, want_ent, _ = trl.GRPOTrainer._get_per_token_logps_and_entropies(
            trainer, trainer.model, ids, mask, R, compute_entropy=True)
    torch.testing.assert_close(got_lp, want_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_ent, want_ent, rtol=1e-5, atol=1e-5)
    assert (got_lp[mask[:, -R:] == 0] == 0).all()


# ---------------------------------------------------------------------- optimizers
def test_sgd_parameters_are_linear_in_the_gradients(model_dir):
    """Plain SGD: the parameters are linear in the accumulated gradients, so 1e-4 of the
    update tests the gradients themselves."""
    compare(model_dir, loss_type="dapo", beta=0.04, optim="sgd", learning_rate=1.0)


def test_default_adamw(model_dir):
    """TRL's defaults (AdamW, eps 1e-8). Adam's sign-like step at near-zero gradients
    amplifies float32 rounding (measured: 6e-5 of the update here, up to 3e-4 in other
    configurations), hence the looser bound."""
    cfg = dict(loss_type="grpo", beta=0.04, adam_epsilon=1e-8)
    ref, ref_after, before = train(trl.GRPOTrainer, model_dir, config(**cfg))
    tree, tree_after, _ = train(TreeGRPOTrainer, model_dir, config(**cfg))
    assert_same_parameters(tree_after, ref_after, before, tol=1e-3)
    assert_same_logs(tree.state.log_history, ref.state.log_history)


# ---------------------------------------------------------------------- DDP
DDP_TIMEOUT_S = 240


def _ddp_worker(rank: int, world: int, port: int, model_dir: str, out_dir: str) -> None:
    import traceback

    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TRL_EXPERIMENTAL_SILENCE="1")
    torch.set_num_threads(1)
    try:
        out = {}
        for name, cls in (("trl", trl.GRPOTrainer), ("tree", TreeGRPOTrainer)):
            cfg = config(loss_type="dapo", beta=0.04, ddp_backend="gloo", per_device_train_batch_size=2)
            trainer, after, before = train(cls, model_dir, cfg)
            out[name] = dict(after=after, before=before, logs=trainer.state.log_history,
                             wrapped=type(trainer.model_wrapped).__name__)
        torch.save(out, os.path.join(out_dir, f"rank{rank}.pt"))
    except BaseException:
        with open(os.path.join(out_dir, f"rank{rank}.err"), "w") as f:
            f.write(traceback.format_exc())
        raise


@pytest.mark.distributed
def test_ddp_two_ranks(model_dir):
    """2 ranks (gloo, CPU) under DDP: every rank's parameters equal GRPOTrainer's, and the
    ranks agree (dtree's gradients are averaged over ranks on the step's last micro-batch,
    as DDP does)."""
    import datetime
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out_dir = tempfile.mkdtemp(prefix="dtree_trl_ddp_")
    ctx = mp.start_processes(_ddp_worker, args=(2, port, model_dir, out_dir), nprocs=2, join=False, start_method="spawn")
    deadline = datetime.datetime.now() + datetime.timedelta(seconds=DDP_TIMEOUT_S)
    try:
        while not ctx.join(timeout=5):
            if datetime.datetime.now() > deadline:
                raise TimeoutError(f"2 ranks did not finish in {DDP_TIMEOUT_S} s (a hang?)")
    except Exception:
        errors = [open(os.path.join(out_dir, f)).read() for f in os.listdir(out_dir) if f.endswith(".err")]
        raise AssertionError("\n".join(errors) or "a rank failed") from None
    finally:
        for p in ctx.processes:  # only the processes this test started
            if p.is_alive():
                p.kill()
    ranks = [torch.load(os.path.join(out_dir, f"rank{r}.pt"), weights_only=False) for r in range(2)]
    for res in ranks:
        assert res["trl"]["wrapped"] == res["tree"]["wrapped"] == "DistributedDataParallel"
        assert_same_parameters(res["tree"]["after"], res["trl"]["after"], res["trl"]["before"])
        assert_same_logs(res["tree"]["logs"], res["trl"]["logs"])
    for name, p in ranks[0]["tree"]["after"].items():
        torch.testing.assert_close(ranks[1]["tree"]["after"][name], p, rtol=0, atol=0)


@pytest.mark.parametrize(("use_vllm", "mode", "freed"), [(True, "colocate", True), (True, "server", None), (False, None, None)])
def test_colocated_vllm_gets_the_cache_back_after_every_call(monkeypatch, use_vllm, mode, freed):
    """With vLLM in the trainer's process (``vllm_mode="colocate"``) dtree returns the
    allocator's cache after every call (vLLM wakes up into that memory); otherwise the
    runtime's default (keep it) holds; an explicit option always wins."""
    from types import SimpleNamespace

    from dtree.integrations.trl import TreeGRPOTrainer

    def fake_init(self, *args, **kwargs):
        self.args = SimpleNamespace(gradient_checkpointing=False, vllm_mode=mode)
        self.use_vllm = use_vllm

    monkeypatch.setattr(trl.GRPOTrainer, "__init__", fake_init)
    assert TreeGRPOTrainer().dtree_options.get("free_after_step") is freed
    explicit = TreeGRPOTrainer(dtree_options={"free_after_step": False}).dtree_options
    assert explicit["free_after_step"] is False
