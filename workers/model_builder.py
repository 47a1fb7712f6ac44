"""Build Hugging Face checkpoints from nothing: a byte-level BPE tokenizer trained on the repo's corpus and a
randomly initialised Llama / Qwen2 / Qwen3 / Phi-3 / OPT / Gemma 2 / Gemma 3 (text) made with transformers' own
classes, saved in the usual layout.

    out/
      config.json  generation_config.json  model.safetensors (or model-0000k-of-0000n.safetensors + index)
      tokenizer.json  tokenizer_config.json  special_tokens_map.json

Builds are deterministic: the same (arch, preset, seed) and library versions give the same files.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers

from workers.model_source import DEFAULT_MODEL, cached_model_path  # noqa: F401 - DEFAULT_MODEL: kept importable here

CORPUS_PATH = Path(__file__).parent / "data" / "corpus.txt"
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>")  # ids 0..4
PAD_ID, BOS_ID, EOS_ID, IM_START_ID, IM_END_ID = range(len(SPECIAL_TOKENS))
# Qwen2's split (cl100k-like: single digits, words with one leading punctuation char) followed by byte-level
# mapping, after NFC. transformers >= 5 rebuilds any qwen2 checkpoint's tokenizer with exactly this pipeline
# from vocab and merges, so using it for every arch keeps AutoTokenizer and tokenizer.json in agreement.
SPLIT_PATTERN = (r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
                 r"""|\s*[\r\n]+|\s+(?!\S)|\s+""")
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
DTYPES = ("float32", "bfloat16", "float16")

# preset -> config kwargs by family. "125m" is OPT-125m's shape (and vocab) for every arch, "1b" and "odd"
# set theirs too; any other preset takes its vocab_size from the tokenizer.
_COMMON: dict[str, dict] = {
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4),
    "small": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8),
    "medium": dict(hidden_size=1024, num_hidden_layers=16, num_attention_heads=16),
    "125m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, vocab_size=50272),
    # a 1B-class shape (Llama-3.2-1B-like) for GPU benchmarks: the tokenizer's ids fill the first 4096 rows
    "1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, vocab_size=32768),
    # widths that are not multiples of 64 (nor of the vector width past 8 lanes): head size 40, GQA 5:1,
    # a vocabulary of 4100 (the tokenizer's 4096 ids and 4 never produced), for kernels' ragged splits
    "odd": dict(hidden_size=200, num_hidden_layers=2, num_attention_heads=5, vocab_size=4100),
}
_GATED_MLP: dict[str, dict] = {  # llama, qwen2
    "tiny": dict(num_key_value_heads=2, intermediate_size=128, max_position_embeddings=2048),
    "small": dict(num_key_value_heads=2, intermediate_size=1408, max_position_embeddings=4096),
    "medium": dict(num_key_value_heads=4, intermediate_size=2816, max_position_embeddings=4096),
    "125m": dict(num_key_value_heads=12, intermediate_size=3072, max_position_embeddings=2048),
    "1b": dict(num_key_value_heads=8, intermediate_size=8192, max_position_embeddings=4096),
    "odd": dict(num_key_value_heads=1, intermediate_size=520, max_position_embeddings=2048),
}
# mixture-of-experts presets (every _COMMON size): Mixtral's 8 experts top 2 at tiny, else 4 experts top 2,
# each expert a small gated MLP (a quarter of the dense intermediate at tiny, odd widths at odd); Qwen3-MoE
# with 8 experts top 2 (tiny/odd) or 16 top 4, norm_topk_prob off at tiny so both router forms are tested,
# and a dense layer (mlp_only_layers) where there is a second layer.
_MOE: dict[str, dict] = {
    "tiny": dict(num_experts=8, top_k=2, expert=48),
    "small": dict(num_experts=4, top_k=2, expert=704),
    "medium": dict(num_experts=8, top_k=2, expert=1408),
    "125m": dict(num_experts=8, top_k=2, expert=768),
    "1b": dict(num_experts=8, top_k=2, expert=2048),
    "odd": dict(num_experts=6, top_k=2, expert=136),
}


def _mixtral(p: str) -> dict:
    moe = _MOE[p]
    return {**_GATED_MLP[p], "intermediate_size": moe["expert"], "num_local_experts": moe["num_experts"],
            "num_experts_per_tok": moe["top_k"], "rope_theta": 1e6, "sliding_window": None,
            "tie_word_embeddings": False, "router_jitter_noise": 0.0}


def _qwen3_moe(p: str, common: dict) -> dict:
    moe = _MOE[p]
    return {**_GATED_MLP[p], "moe_intermediate_size": moe["expert"], "num_experts": moe["num_experts"],
            "num_experts_per_tok": moe["top_k"], "norm_topk_prob": p != "tiny", "decoder_sparse_step": 1,
            "mlp_only_layers": [1] if common["num_hidden_layers"] > 1 else [],
            "head_dim": 2 * common["hidden_size"] // common["num_attention_heads"], "rope_theta": 1e6,
            "tie_word_embeddings": False, "use_sliding_window": False}


_OPT_FFN = {"tiny": 256, "small": 2048, "medium": 4096, "125m": 3072, "1b": 8192, "odd": 520}


def _init_std(common: dict) -> float:
    # Fan-in init, N(0, 1/hidden): activations stay O(1) and the last-position logits of a short prompt have
    # std ~1.0 (measured 0.99-1.01 on tiny and small, every arch). transformers' usual 0.02 gives 0.16 (tiny)
    # and 0.45 (small) with top-2 gaps down to 0.003, so greedy decoding would be decided by rounding noise.
    return round(common["hidden_size"] ** -0.5, 6)


def _phi3(preset: str, common: dict) -> dict:
    """Phi-4-mini's shape of rope: partial rotary (0.75 of each head) under longrope, with an original
    context of an eighth of max_position_embeddings (tiny: 256 of 2048; ``factor`` 8, their ratio, as
    transformers asks) so short prompts stay under it and the suite's longest ones pass it; factors
    spread as in Phi-3's (short near 1, long up to ~8)."""
    gated = _GATED_MLP[preset]
    half = int(common["hidden_size"] // common["num_attention_heads"] * 0.75) // 2
    original = gated["max_position_embeddings"] // 8
    rope = {"rope_type": "longrope", "rope_theta": 10000.0, "partial_rotary_factor": 0.75, "factor": 8.0,
            "original_max_position_embeddings": original,
            "short_factor": [round(1 + 0.5 * i / half, 4) for i in range(half)],
            "long_factor": [round(1 + 7 * i / half, 4) for i in range(half)]}
    return {**common, **gated, "initializer_range": _init_std(common), "rms_norm_eps": 1e-5,
            "original_max_position_embeddings": original, "rope_parameters": rope, "tie_word_embeddings": True,
            "sliding_window": None}


PRESETS: dict[str, dict[str, dict]] = {
    "llama": {p: {**c, **_GATED_MLP[p], "initializer_range": _init_std(c), "rms_norm_eps": 1e-5,
                  "rope_theta": 10000.0, "tie_word_embeddings": False} for p, c in _COMMON.items()},
    "qwen2": {p: {**c, **_GATED_MLP[p], "initializer_range": _init_std(c), "rope_theta": 1e6,
                  "tie_word_embeddings": True, "use_sliding_window": False} for p, c in _COMMON.items()},
    "opt": {p: {**c, "ffn_dim": _OPT_FFN[p], "max_position_embeddings": 2048, "do_layer_norm_before": True,
                "word_embed_proj_dim": c["hidden_size"], "init_std": _init_std(c)} for p, c in _COMMON.items()},
    # head_dim twice hidden / heads (Qwen3-0.6B: 1024 / 16 heads of 128), so the explicit head_dim matters
    "qwen3": {p: {**c, **_GATED_MLP[p], "head_dim": 2 * c["hidden_size"] // c["num_attention_heads"],
                  "initializer_range": _init_std(c), "rope_theta": 1e6, "tie_word_embeddings": True,
                  "use_sliding_window": False} for p, c in _COMMON.items()},
    "phi3": {p: _phi3(p, c) for p, c in _COMMON.items()},
    "mixtral": {p: {**c, **_mixtral(p), "initializer_range": _init_std(c), "rms_norm_eps": 1e-5}
                for p, c in _COMMON.items()},
    "qwen3_moe": {p: {**c, **_qwen3_moe(p, c), "initializer_range": _init_std(c)} for p, c in _COMMON.items()},
}
# Gemma presets (tiny and small only): sliding windows shorter than the suite's longer prompts (500 tokens),
# query_pre_attn_scalar unlike head_dim, and soft-caps low enough to change scores and logits of this init
# (Gemma 2's real ones are 50 and 30). gemma2 tiny has head size 256 (four layers: sliding, global, ...);
# gemma3 tiny six layers, five local per global, the global ones with linear rope scaling.
_GEMMA: dict[str, dict] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                 max_position_embeddings=2048),
    "small": dict(hidden_size=512, intermediate_size=1408, num_attention_heads=8, num_key_value_heads=2,
                  max_position_embeddings=4096),
}
_GEMMA2 = {"tiny": dict(num_hidden_layers=4, head_dim=256, sliding_window=48, query_pre_attn_scalar=64),
           "small": dict(num_hidden_layers=8, head_dim=256, sliding_window=256, query_pre_attn_scalar=128)}
_GEMMA3 = {"tiny": dict(num_hidden_layers=6, head_dim=64, sliding_window=40, query_pre_attn_scalar=32),
           "small": dict(num_hidden_layers=12, head_dim=128, sliding_window=256, query_pre_attn_scalar=64)}
PRESETS["gemma2"] = {p: {**c, **_GEMMA2[p], "initializer_range": _init_std(c), "attn_logit_softcapping": 3.0,
                         "final_logit_softcapping": 5.0, "hidden_activation": "gelu_pytorch_tanh"}
                     for p, c in _GEMMA.items()}
PRESETS["gemma3"] = {p: {**c, **_GEMMA3[p], "initializer_range": _init_std(c), "final_logit_softcapping": 5.0,
                         "rope_parameters": {"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                "rope_theta": 1e6},
                                             "sliding_attention": {"rope_type": "default", "rope_theta": 1e4}}}
                     for p, c in _GEMMA.items()}
_CLASSES = {  # arch -> (config class, model class), both from transformers
    "llama": ("LlamaConfig", "LlamaForCausalLM"),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
    "opt": ("OPTConfig", "OPTForCausalLM"),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
    "phi3": ("Phi3Config", "Phi3ForCausalLM"),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM"),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM"),
}


def _preset(arch: str, preset: str) -> dict:
    if arch not in PRESETS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(PRESETS)}")
    if preset not in PRESETS[arch]:
        raise ValueError(f"unknown preset {preset!r}; choose one of {', '.join(PRESETS[arch])}")
    return dict(PRESETS[arch][preset])


def train_tokenizer(vocab_size: int = 4096) -> Tokenizer:
    """Train the project's byte-level BPE on corpus.txt; `<s>` is prepended to every encoding.

    Deterministic: the trainer breaks count ties by pair id, so repeated trainings (any thread count, any
    process) give byte-identical `to_str()`.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.normalizer = normalizers.NFC()
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train([str(CORPUS_PATH)], trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", BOS_ID)])
    return tokenizer


def _save_tokenizer(tokenizer: Tokenizer, out: Path, model_max_length: int) -> None:
    special = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>"}
    files = {
        # unk_token null: otherwise transformers' Qwen2Tokenizer adds its default "<|endoftext|>" as token 4096.
        "tokenizer_config.json": {"tokenizer_class": "PreTrainedTokenizerFast", **special, "unk_token": None,
                                  "model_max_length": model_max_length, "clean_up_tokenization_spaces": False,
                                  "chat_template": CHAT_TEMPLATE},
        "special_tokens_map.json": {**special, "additional_special_tokens": list(SPECIAL_TOKENS[3:])},
    }
    tokenizer.save(str(out / "tokenizer.json"))
    for name, content in files.items():
        (out / name).write_text(json.dumps(content, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


@contextlib.contextmanager
def without_triton() -> Iterator[None]:
    """Hide Triton from what a build imports where this process cannot run it: a CPU-only torch and no
    Triton interpreter (``TRITON_INTERPRET=1``). transformers' model classes import torch._dynamo, which
    imports triton to see whether it is installed; building never uses it, and a process that imported it
    ends, after an engine ran, with ~27 lines of ``nanobind: leaked ...`` on stderr (``make demo``'s first
    run). While hidden, ``import triton`` raises ImportError (torch then caches "no Triton" for its own
    compiler, which kvserve does not use); ``kernels.triton`` imports it normally afterwards."""
    hide = ("triton" not in sys.modules and os.environ.get("TRITON_INTERPRET", "0") != "1"
            and torch.version.cuda is None and torch.version.hip is None)
    if hide:
        sys.modules["triton"] = None  # type: ignore[assignment]
    try:
        yield
    finally:
        if hide and "triton" in sys.modules and sys.modules["triton"] is None:
            del sys.modules["triton"]


@contextlib.contextmanager
def _no_progress_bars() -> Iterator[None]:
    from transformers.utils import logging  # save_pretrained draws a tqdm bar on stderr

    enabled = logging.is_progress_bar_enabled()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        if enabled:
            logging.enable_progress_bar()


def make_model(arch: str, preset: str, out: str | Path, seed: int = 0, dtype: str = "float32",
               max_shard_size: str | None = None, num_layers: int | None = None, train_steps: int = 0) -> Path:
    """Build a random `arch`/`preset` checkpoint with its tokenizer into `out`; return `out` resolved.

    The weights are drawn in float32 right after `torch.manual_seed(seed)` (the caller's RNG state is restored
    afterwards) and then cast, so every dtype holds the same model. The build goes to a temporary sibling that is
    renamed to `out` at the end: `out` either holds a complete checkpoint or does not exist. `max_shard_size`
    (e.g. "200KB") splits the weights into shards listed in `model.safetensors.index.json`. `num_layers`: that
    many decoder layers instead of the preset's. `train_steps` > 0: that many steps of next-token training on
    the corpus (workers/model_training.py) before the cast, the report in `training.json` beside the weights.
    Raises ValueError for an unknown arch, preset or dtype and FileExistsError if `out` is a non-empty directory.
    """
    with without_triton():
        return _make_model(arch, preset, out, seed, dtype, max_shard_size, num_layers, train_steps)


def _make_model(arch: str, preset: str, out: str | Path, seed: int, dtype: str, max_shard_size: str | None,
                num_layers: int | None = None, train_steps: int = 0) -> Path:
    import transformers  # slow to import; only building needs it

    kwargs = _preset(arch, preset)
    if num_layers is not None:
        if num_layers < 1 or "layer_types" in kwargs:
            raise ValueError(f"num_layers must be >= 1 for a preset without per-layer types, got {num_layers}")
        kwargs["num_hidden_layers"] = num_layers
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    if train_steps < 0:
        raise ValueError(f"train steps must be >= 0, got {train_steps}")
    out = Path(out).expanduser().resolve()
    if out.exists() and any(out.iterdir()):
        raise FileExistsError(f"{out} exists and is not empty; remove it or choose another output directory")
    tokenizer = train_tokenizer()
    kwargs.setdefault("vocab_size", math.ceil(tokenizer.get_vocab_size() / 64) * 64)
    config_cls, model_cls = (getattr(transformers, name) for name in _CLASSES[arch])
    config = config_cls(**kwargs, bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = model_cls(config)
        if arch.startswith("gemma"):  # (1 + weight) norms: transformers starts them at 0, which tests nothing
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.data.normal_(0.0, 0.2)
    training = None
    if train_steps:
        from workers.model_training import train_on_corpus

        training = train_on_corpus(model, tokenizer, steps=train_steps, seed=seed, bos_id=BOS_ID)
    model.to(getattr(torch, dtype))
    model.generation_config = transformers.GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=[EOS_ID, IM_END_ID], pad_token_id=PAD_ID)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        with _no_progress_bars():  # no max_shard_size: one file (no preset comes near 1000GB)
            model.save_pretrained(tmp, max_shard_size=max_shard_size or "1000GB")
        _save_tokenizer(tokenizer, tmp, config.max_position_embeddings)
        if training is not None:
            (tmp / "training.json").write_text(json.dumps(training.as_dict(), indent=2) + "\n")
        tmp.chmod(0o755)  # mkdtemp makes it 0o700
        if out.exists():
            out.rmdir()
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def ensure_model(arch: str = "llama", preset: str = "small", seed: int = 0, dtype: str = "float32") -> Path:
    """Return the cached checkpoint `$KVSERVE_CACHE_DIR/models/{arch}-{preset}-seed{seed}` (default cache dir
    ~/.cache/kvserve; `-{dtype}` appended for other dtypes than float32), building it first if it is missing.
    Concurrent callers, in any process, build it once.

    The cache is keyed by name only: after changing the corpus or the presets, delete the old builds.
    """
    _preset(arch, preset)
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(DTYPES)}")
    path = cached_model_path(arch, preset, seed, dtype)
    models_dir = path.parent
    if path.is_dir():  # builds are renamed into place when complete, so a directory that exists is complete
        return path
    models_dir.mkdir(parents=True, exist_ok=True)
    with open(models_dir / f".{path.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes
        if not path.is_dir():
            make_model(arch, preset, path, seed, dtype=dtype)
    return path


def default_model_dir() -> Path:
    """The checkpoint used when none is given: `ensure_model(*DEFAULT_MODEL)`."""
    return ensure_model(*DEFAULT_MODEL)


def num_parameters(model_dir: str | Path) -> int:
    """Count the parameters stored in a checkpoint's safetensors files (tied weights count once)."""
    total = 0
    for path in Path(model_dir).glob("*.safetensors"):
        with open(path, "rb") as f:  # safetensors: u64 little-endian header size, then a JSON header
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        total += sum(math.prod(t["shape"]) for name, t in header.items() if name != "__metadata__")
    return total


def add_make_model_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the `kvserve make-model` options to `parser`."""
    parser.add_argument("--arch", choices=list(PRESETS), default="llama")
    parser.add_argument("--preset", choices=list(_COMMON), default="small")
    parser.add_argument("--out", required=True, help="output directory; must not exist or be empty")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", choices=DTYPES, default="float32")
    parser.add_argument("--max-shard-size", help='shard the weights, e.g. "200KB" (default: a single file)')
    parser.add_argument("--train-steps", type=int, default=0,
                        help="train that many steps on the corpus before saving (default 0: random weights)")


def run_make_model(args: argparse.Namespace) -> int:
    """Run `kvserve make-model`: build the checkpoint, print its directory and parameter count."""
    try:
        out = make_model(args.arch, args.preset, args.out, seed=args.seed, dtype=args.dtype,
                         max_shard_size=args.max_shard_size, train_steps=args.train_steps)
    except (ValueError, FileExistsError) as e:
        print(f"make-model: {e}", file=sys.stderr)
        return 2
    print(out)
    print(f"{args.arch}-{args.preset} ({args.dtype}): {num_parameters(out):,} parameters")
    if args.train_steps:
        t = json.loads((out / "training.json").read_text())
        print(f"trained {t['steps']} steps ({t['train_tokens_seen']:,} tokens) in {t['seconds']:.0f} s: train loss "
              f"{t['initial_train_loss']:.2f} -> {t['final_train_loss']:.2f}, held-out "
              f"{t['initial_held_out_loss']:.2f} -> {t['held_out_loss']:.2f}")
    return 0
