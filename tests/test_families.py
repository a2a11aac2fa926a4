"""Breadth: every decoder-only ``*ForCausalLM`` family of the installed transformers is
either exact against HF run per path, or refused with a ValueError naming the feature.

The families are those of ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` (plus a few extra
configurations of one family, :data:`family_configs.VARIANTS`), each built tiny and
random in float32 (``tests/family_configs.py``). For each one, dtree trains a small
branching forest (``forward_backward``, NLL). Then:

* it ran: every parameter gradient and the loss must equal HF's per-path training
  (relative error <= 1e-5, floored at gradients that vanish by symmetry:
  ``reference.grad_errors``). A family whose own HF training fails at these sizes is
  skipped with the error;
* it raised a ValueError: the message must name the feature (:data:`EXPECTED`), and
  ``param.grad`` must be untouched.

:data:`EXPECTED` records the outcome of every family known today. A family listed exact
that is refused, or refused for another reason, fails. A family of a newer
transformers that is not listed is tried the same way (exact or refused, never wrong);
one whose small config cannot be built is skipped with the reason. Out-of-scope
entries (encoders, decoder halves of encoder-decoders, multimodal wrappers) are skipped
with theirs. ``test_exact_families_do_not_shrink`` keeps the exact set from shrinking.

The default run trains each family once with the default runtime settings (and with
``group_tokens=0`` for the families the issue named); ``-m slow`` runs every exact
family in four settings: default, ``group_tokens=0``, ``mode="recompute"`` and
``checkpoint_layers=True`` (every layer re-run in backward). The recurrent hybrids also
run :data:`HYBRID_SETTINGS` on :func:`branching_forest` (several levels of branching, a
node shorter than the convolution windows), a seeded subset by default, all under
``-m slow``.
"""

from __future__ import annotations

import copy
import os
import random
import re
import warnings

import pytest
import torch
import transformers
from family_configs import OUT_OF_SCOPE, VARIANTS, VOCAB, small_config
from reference import grad_errors, linearized_step
from transformers import AutoModelForCausalLM
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

import dtree

FP32_TOL = 1e-5
_TRANSFORMERS = tuple(int(x) for x in transformers.__version__.split(".")[:2])
EXACT = "exact"

# what each refusal must say (the feature), by kind
NO_ATTENTION = r"has no attention"
MIXER = r"has no attention module: its token mixer"
BYPASS = r"does not use transformers' attention interface"
LINEAR = r"is a linear-attention \(recurrent\) layer"
MIXES_TOKENS = r"mixes tokens outside the attention function"
ATTENDS_TWICE = r"called dtree's attention \d+ times in one model call"
OWN_MASK = r"passes its own attention mask or score bias"
NEEDS_MASK = r"failed in its own code while dtree ran it"
LOGITS = r"post-processes its logits"
PER_LAYER = r"its layers have different attention shapes"
DIFFERS = r"differ from the model's own forward"
UNKNOWN_KWARG = r"passed 'position_bias' to its attention function"

# every family known today -> EXACT, or the regex its refusal must match
EXPECTED: dict[str, str] = {
    **{
        name: EXACT
        for name in (
            # through transformers' attention interface
            "afmoe", "apertus", "arcee", "aria_text", "axk1", "beam", "biogpt", "bitnet", "cohere", "cohere2",
            "cohere2_moe", "ctrl", "cwm", "deepseek_v3", "ernie4_5", "ernie4_5_moe", "exaone4", "exaone_moe",
            "flex_olmo", "flint", "gemma", "gemma2", "gemma3_text", "glm", "glm4", "glm4_moe", "glm4_moe_lite",
            "gpt-sw3", "gpt2", "gpt_bigcode", "gpt_neox", "gpt_oss", "granite", "granite_swa", "granitemoe",
            "granitemoe_swa", "granitemoeshared", "helium", "hunyuan_v1_dense", "hunyuan_v1_moe", "hy_v3",
            "hyperclovax", "internlm3", "iquestcoder", "jais2", "jetmoe", "kolibri1", "laguna", "llama",
            "llama4_text", "longcat_flash", "mellum", "minicpm3", "minimax_m2", "minimax_m3_vl_text", "ministral",
            "ministral3", "mistral", "mixtral", "nanochat", "nemotron", "olmo", "olmo2", "olmo3", "olmoe",
            "opt", "persimmon", "phi", "phi3", "phimoe", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "seed_oss",
            "smollm3", "solar_open", "stablelm", "starcoder2", "vaultgemma", "youtu", "gpt_bigcode:mha", "dbrx",
            "deepseek_v2", "dots1", "gemma3n_text", "gemma3n_text:kv_shared",
            # layers with K/V shapes of their own (a KV stack per shape)
            "gemma4_text", "gemma4_unified_text", "mimo_v2_flash",
            # hybrids: recurrent layers through dtree/models/mixers and the state stack
            "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear", "lfm2", "lfm2_moe",
            "nemotron_h", "granitemoehybrid", "jamba", "bamba", "falcon_h1", "falcon_h1:rms_norm", "minimax",
            # through an adapter of dtree/models/families.py
            "bloom", "codegen", "falcon", "falcon:new_arch", "falcon:alibi", "falcon:alibi_mq", "gpt_neo", "gptj",
            "mpt", "gpt_neox_japanese", "openai-gpt", "xglm",
        )
    },
    "mamba": NO_ATTENTION,
    "mamba2": NO_ATTENTION,
    "falcon_mamba": NO_ATTENTION,
    "rwkv": NO_ATTENTION,
    "xlstm": NO_ATTENTION,
    "lfm3": MIXER,
    "recurrent_gemma": MIXER,
    "zamba": MIXER,
    "zaya": MIXES_TOKENS,
    "bailing_hybrid": LINEAR,
    "cpmant": BYPASS,
    "diffllama": ATTENDS_TWICE,
    "hrm_text": ATTENDS_TWICE,
    "doge": OWN_MASK,
    "axk2": NEEDS_MASK,
    "deepseek_v32": NEEDS_MASK,
    "glm_moe_dsa": NEEDS_MASK,
    "hy_v4": NEEDS_MASK,
    "modernbert-decoder": LOGITS,
    "dots3_note_text": PER_LAYER,
    "inkling_text": UNKNOWN_KWARG,
    "inkling2_text": UNKNOWN_KWARG,
    "deepseek_v4": DIFFERS,
    # transformers < 5.18 runs MoshiModel without a causal mask when no attention_mask is given
    "moshi": EXACT if _TRANSFORMERS >= (5, 18) else DIFFERS,
}

NOT_TESTABLE = "not testable"  # HF's own forward cannot run it at this size on this release

# Older releases, down to pyproject.toml's lower bound (CI runs the families there too),
# implement some families differently, and dtree refuses them there for another clear
# reason: name -> (the oldest release checked to behave as EXPECTED says, the outcome on
# older ones). Checked on 5.10.4, 5.17 and 5.24.
OLDER_RELEASES: dict[str, tuple[tuple[int, int], str]] = {
    "ctrl": ((5, 17), BYPASS),  # its attention moved onto the interface after 5.10
    "nemotron": ((5, 17), BYPASS),
    "moshi": ((5, 17), BYPASS),
    "diffllama": ((5, 17), BYPASS),
    "glm_moe_dsa": ((5, 17), OWN_MASK),
    "zamba": ((5, 17), NOT_TESTABLE),  # 5.10 needs the CUDA mamba kernels even on CPU
}


def expected_outcome(name: str) -> str | None:
    """EXACT, the regex a refusal must match, NOT_TESTABLE, or None (unknown family)
    under the installed transformers."""
    if name in OLDER_RELEASES and _TRANSFORMERS < OLDER_RELEASES[name][0]:
        return OLDER_RELEASES[name][1]
    return EXPECTED.get(name)

# the families the issue named: exact whenever the installed transformers has them
MUST_BE_EXACT = {
    "llama", "qwen2", "qwen3", "mistral", "mixtral", "qwen2_moe", "qwen3_moe", "gemma", "gemma2", "gemma3_text",
    "phi", "phi3", "gpt2", "gpt_neox", "opt", "starcoder2", "olmo", "olmo2", "smollm3", "gpt_oss", "cohere",
    "bloom", "gptj", "granite", "deepseek_v3", "falcon", "falcon:alibi", "stablelm",
}

FAMILIES = sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) + sorted(VARIANTS)


def forest_sequences(seed: int = 0) -> list[list[int]]:
    """A small branching forest: a shared prompt, a nested branch, a path that is a
    prefix of another, and a second tree."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(3, VOCAB, (n,), generator=gen).tolist()

    prompt, mid = tokens(4), tokens(3)
    return [prompt + mid + tokens(2), prompt + mid + tokens(3), prompt + tokens(4), prompt + mid, tokens(5)]


def branching_forest(seed: int = 0) -> list[list[int]]:
    """Several levels of branching for the recurrent hybrids: a 5-token prompt (two
    segments at ``chunk_size=3``), a 2-token node below it with a 1-token child (shorter
    than the convolution windows, which then reach two nodes up) that branches again,
    a sibling, a prefix of another path, a duplicate, and a second tree."""
    gen = torch.Generator().manual_seed(seed)

    def tokens(n):
        return torch.randint(3, VOCAB, (n,), generator=gen).tolist()

    prompt, mid, one, other = tokens(5), tokens(2), tokens(1), tokens(3)
    return [
        prompt + mid + one + tokens(2), prompt + mid + one + tokens(1), prompt + mid + other, prompt + mid,
        prompt + tokens(4), prompt + mid + other, tokens(3) + tokens(2),
    ]


def _skip_unless_listed(name: str, reason: str) -> None:
    """A family of :data:`EXPECTED` must stay testable (so the tested set cannot shrink
    silently); any other one (new in a newer transformers) is skipped with the reason."""
    if name in EXPECTED:
        pytest.fail(f"{name} is listed in EXPECTED but {reason}")
    pytest.skip(f"{name}: {reason}")


def build(name: str) -> torch.nn.Module:
    """The family's tiny random float32 model in eval mode (no dropout), biases nonzero."""
    if name in OUT_OF_SCOPE:
        pytest.skip(f"{name}: out of scope, {OUT_OF_SCOPE[name]}")
    try:
        config = small_config(name)
        config.use_cache = False
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = AutoModelForCausalLM.from_config(config)
    except Exception as error:
        _skip_unless_listed(name, f"cannot build a small config in transformers {transformers.__version__}: "
                                  f"{type(error).__name__}: {str(error)[:200]}")
    model = model.float().eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("bias"):
                p.normal_(0, 0.02)
    return model


def run_family(name: str, sequences: list[list[int]] | None = None, **runtime_kw) -> str:
    """Exact against HF per path, or refused as :data:`EXPECTED` says; see the module
    docstring. Returns ``"exact"`` or the refusal's message."""
    expected = expected_outcome(name)
    if expected == NOT_TESTABLE:
        pytest.skip(f"{name}: HF's own forward cannot run it on CPU in transformers {transformers.__version__}")
    model = build(name)
    seqs = forest_sequences() if sequences is None else sequences
    try:
        with torch.no_grad():
            model(input_ids=torch.tensor([seqs[0]]))
    except Exception as error:
        _skip_unless_listed(name, f"HF's own forward fails at this size: {type(error).__name__}: {str(error)[:200]}")
    tree_model = copy.deepcopy(model)
    try:
        runtime = dtree.TreeRuntime(tree_model, **runtime_kw)
        out = runtime.forward_backward(dtree.Forest.from_sequences(seqs), dtree.losses.nll())
    except ValueError as error:
        message = str(error)
        assert all(p.grad is None for p in tree_model.parameters()), f"{name}: a refusal touched param.grad"
        assert expected != EXACT, f"{name} is listed exact but was refused: {message}"
        if expected is not None:
            assert re.search(expected, message), f"{name}: refused for another reason than {expected!r}: {message}"
        return message
    assert expected in (EXACT, None), f"{name} is listed as refused ({expected!r}) but ran: check it and update EXPECTED"
    ref_model = copy.deepcopy(model)
    try:
        ref_loss, _ = linearized_step(ref_model, seqs)
    except Exception as error:
        _skip_unless_listed(name, f"HF's own per-path training fails at this size: {type(error).__name__}: {error}")
    errors = grad_errors(tree_model, ref_model)
    worst = max(errors, key=errors.get)
    assert errors[worst] <= FP32_TOL, f"{name} {runtime_kw}: gradient of {worst} off by {errors[worst]:.2e}"
    assert abs(out.loss - ref_loss) <= FP32_TOL * max(1.0, abs(ref_loss)), (name, runtime_kw, out.loss, ref_loss)
    return EXACT


@pytest.mark.parametrize("name", FAMILIES)
def test_family(name):
    run_family(name)


@pytest.mark.parametrize("name", sorted(MUST_BE_EXACT))
def test_named_family_one_segment_per_call(name):
    """The issue's families with group_tokens=0: every segment its own model call (the
    childless-group path the issue's silent failures slipped through)."""
    run_family(name, group_tokens=0)


SWEEP_SETTINGS = {
    "default": {}, "calls": {"group_tokens": 0}, "recompute": {"mode": "recompute"},
    "checkpoint_layers": {"checkpoint_layers": True, "group_tokens": 8},
}
_SWEEP_CASES = [(n, k) for n in sorted(n for n in EXPECTED if expected_outcome(n) == EXACT and n in FAMILIES)
                for k in SWEEP_SETTINGS]
# By default a seeded sample (DTREE_TEST_SEED, default 0) and the cases that once failed: Gemma 3n's KV-shared
# layers under layer checkpointing lost the shared keys' and values' gradients from 813ed54 to session AF
# (dtree's recompute ran the layer that stores them with grad off); `-m slow` runs them all.
_SWEEP_DEFAULT = set(random.Random(int(os.environ.get("DTREE_TEST_SEED", "0"))).sample(_SWEEP_CASES, 6)) | {
    ("gemma3n_text:kv_shared", "checkpoint_layers")}


@pytest.mark.parametrize(
    ("name", "setting"),
    [pytest.param(n, k, marks=() if (n, k) in _SWEEP_DEFAULT else pytest.mark.slow) for n, k in _SWEEP_CASES],
)
def test_exact_family_sweep(name, setting):
    run_family(name, chunk_size=3, **SWEEP_SETTINGS[setting])


# The recurrent hybrids in every memory plan, on branching_forest: node-by-node calls
# (every state through the stack), retain and recompute over packed groups, layer
# checkpointing (layers re-run in backward re-read and re-seed their states), and the
# whole forest in one call (in-call parents only). A seeded subset runs by default.
# transformers 5.10 has all of them but kimi_linear (skipped there); 5.17 and 5.24 have all.
HYBRID = (
    "qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "olmo_hybrid", "kimi_linear", "lfm2", "lfm2_moe", "nemotron_h",
    "granitemoehybrid", "jamba", "bamba", "falcon_h1", "falcon_h1:rms_norm", "minimax",
)
HYBRID_SETTINGS = {
    "calls": dict(group_tokens=0, chunk_size=3),
    "retain": dict(mode="retain", group_tokens=8, chunk_size=3),
    "recompute": dict(mode="recompute", group_tokens=8, chunk_size=3),
    "checkpoint_layers": dict(checkpoint_layers=True, group_tokens=8, chunk_size=3),
    "one_call": dict(mode="retain", chunk_size=3),
}
_HYBRID_CASES = [(n, k) for n in HYBRID for k in HYBRID_SETTINGS]
_HYBRID_DEFAULT = set(random.Random(19).sample(_HYBRID_CASES, 6))


@pytest.mark.parametrize(
    "name, setting",
    [pytest.param(n, k, marks=() if (n, k) in _HYBRID_DEFAULT else pytest.mark.slow) for n, k in _HYBRID_CASES],
)
def test_hybrid_family_settings(name, setting):
    if name.split(":")[0] not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        pytest.skip(f"{name}: not in transformers {transformers.__version__}")
    assert run_family(name, branching_forest(), **HYBRID_SETTINGS[setting]) == EXACT


def test_exact_families_do_not_shrink():
    """The issue's families are listed exact, and the exact set keeps its size: a listed
    family that becomes refused, or cannot be built or checked any more, fails
    test_family; only a family that leaves the installed transformers drops out
    (transformers 5.10: 102 exact, 5.17: 111, 5.24: 117)."""
    installed = set(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES) | set(VARIANTS)
    exact = {n for n in EXPECTED if expected_outcome(n) == EXACT}
    missing = {n for n in MUST_BE_EXACT | set(HYBRID) | {"gemma4_text"} if n.split(":")[0] in installed} - exact
    assert not missing, f"the issue's families must be listed exact: {sorted(missing)}"
    least = 105 if _TRANSFORMERS >= (5, 17) else 100
    assert len(exact & installed) >= least, f"only {len(exact & installed)} exact families"


def test_issue_targets_refused_with_reason():
    """The issue's refusal targets, by name: Falcon in HF's eager ALiBi path (which adds
    the bias twice) names sdpa; a state-space model names the missing attention."""
    model = AutoModelForCausalLM.from_config(small_config("falcon", alibi=True, attn_implementation="eager")).eval()
    with pytest.raises(ValueError, match="adds ALiBi twice.*attn_implementation='sdpa'"):
        dtree.TreeRuntime(model).logprobs(dtree.Forest.from_sequences(forest_sequences()))


def test_readme_lists_every_family():
    """The README's family lists (exact, refused) name every family of EXPECTED."""
    import pathlib

    readme = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    section = readme[readme.index("**Model families.**") : readme.index("**Custom models**")]
    missing = sorted(n for n in EXPECTED if ":" not in n and not re.search(rf"(?<![\w-]){re.escape(n)}(?![\w-])", section))
    assert not missing, f"README's Model families section does not name {missing}"
