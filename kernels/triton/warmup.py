"""Every Triton kernel variant an engine can launch, known before it launches: recorded, enumerated,
and compiled at start.

Triton compiles a kernel once per *variant*: its constexpr values, its arguments' dtypes, and the
specialisation of its other arguments (integers equal to 1 or divisible by 16, pointers aligned to
16 bytes), 1-3 s each on first use. ``kernels.triton.ops`` keeps the arguments that change from step
to step out of the specialisation, so an engine's variants are fixed by its configuration:

- the attention variants (KV store, paged attention per tile shape and split count, the split
  merge) are enumerated here from the backend's own planner (``TritonAttentionBackend.block_q`` and
  ``split_counts``) by running its ``forward`` over meta tensors in a dry run (``record_launches``);
- the layer ops' variants (norms, rotary, SiLU-and-multiply, the batch-invariant linear) depend only
  on the model's widths: one small forward of the model launches every one of them.

``compile_variants`` compiles both before the engine serves (on CUDA: the forward, then Triton's
``warmup`` for each enumerated attention variant, which compiles without launching);
``prepare_runner`` / ``warm_up_runner`` are the model runner's two calls (at its start; after
its KV pool exists, on CUDA). ``compile_for_target``
compiles a recorded launch for a given GPU target with no device (``kernels.triton.compile_check``).
``layer_launches`` enumerates the layer ops at a Llama-family model's widths without the model (for
the compile check; a test pins it to what the models launch); ``moe_launches`` the fused MoE's two
launches at a mixture-of-experts layer's widths.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from kernels.kv_quant import pool_dtype_and_width
from kernels.triton import ops
from kernels.triton.backend import AttentionShape, TritonAttentionBackend
from kernels.triton.moe import BLOCK_M, max_blocks, moe_gemm

logger = logging.getLogger(__name__)


@dataclass
class Launch:
    """One kernel launch, as the ops made it: enough to compile its variant again."""

    kernel: object  # a JITFunction (or an InterpretedFunction under the interpreter)
    grid: tuple
    args: tuple
    constexprs: dict
    key: tuple = field(default=None)  # (kernel name, Triton's specialisation of every argument)

    @property
    def name(self) -> str:
        return _python_fn(self.kernel).__name__


def _python_fn(kernel):
    return kernel.fn


_TWINS: dict[int, object] = {}
_BINDERS: dict[int, Callable] = {}


def _jit(kernel):
    """The compiled-path ``JITFunction`` of a kernel (itself, or a twin of an interpreted one with the
    same specialisation settings)."""
    from triton.runtime.jit import JITFunction

    if isinstance(kernel, JITFunction):
        return kernel
    twin = _TWINS.get(id(kernel))
    if twin is None:
        kw = {k: kernel.kwargs.get(k) for k in ("do_not_specialize", "do_not_specialize_on_alignment")}
        twin = _TWINS[id(kernel)] = JITFunction(kernel.fn, **kw)
    return twin


def _binder(kernel) -> Callable:
    """Triton's own argument binder for a CUDA target: the specialisation a launch computes."""
    binder = _BINDERS.get(id(kernel))
    if binder is None:
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend
        from triton.runtime.jit import create_function_from_signature

        fn = _jit(kernel)
        binder = _BINDERS[id(kernel)] = create_function_from_signature(
            fn.signature, fn.params, make_backend(GPUTarget("cuda", 90, 32)))
    return binder


def variant_key(kernel, args: tuple, constexprs: dict) -> tuple:
    """The variant a launch compiles: the kernel and Triton's specialisation of its arguments (the
    same tuple Triton's launcher keys its cache by)."""
    _, specialization, _ = _binder(kernel)(*args, **constexprs)
    return (_python_fn(kernel).__name__, tuple(tuple(s) for s in specialization))


@contextlib.contextmanager
def record_launches(dry: bool = False) -> Iterator[list[Launch]]:
    """Record every Triton launch of the ops inside the block (with its variant key); ``dry``: record
    only, launch nothing (the enumeration runs over meta tensors). Only this thread's launches: another
    thread's (an engine stepping beside a warm-up) run as usual and are not recorded."""
    launches: list[Launch] = []
    owner = threading.get_ident()

    def hook(kernel, grid, args, constexprs):
        if threading.get_ident() != owner:
            return None
        launches.append(Launch(kernel, grid, args, dict(constexprs), variant_key(kernel, args, constexprs)))
        return not dry

    ops.LAUNCH_HOOKS.append(hook)
    try:
        yield launches
    finally:
        ops.LAUNCH_HOOKS.remove(hook)


def distinct(launches: list[Launch]) -> dict[tuple, Launch]:
    """One launch per variant, in first-seen order."""
    out: dict[tuple, Launch] = {}
    for launch in launches:
        out.setdefault(launch.key, launch)
    return out


# --- enumeration ------------------------------------------------------------------------------------

def attention_launches(backend: TritonAttentionBackend, shape: AttentionShape) -> list[Launch]:
    """Every attention-side launch (KV store, paged attention, merge) ``backend`` can make for
    ``shape``: its forward over meta tensors, dry, for a step of one decode and one prefill chunk (the
    two tile shapes the planner uses) planned by the backend and then run at each split count of
    ``split_counts`` (one under ``deterministic``), over a pool of ``shape.kv_format`` (a quantized
    format's store and attention are variants of their own: KV_FORMAT, uint8 pools)."""
    from kernels.metadata import PagedAttentionMetadata

    meta_device = torch.device("meta")
    h, kvh, d, bs = shape.num_heads, shape.kv_heads, shape.head_dim, shape.block_size
    qkv = torch.empty(3, h + 2 * kvh, d, dtype=shape.dtype, device=meta_device)  # as the qkv split views it
    query, key, value = qkv[:, :h], qkv[:, h:h + kvh], qkv[:, h + kvh:]
    pool_dtype, width = pool_dtype_and_width(shape.kv_format, d, shape.dtype)  # a quantized pool: uint8 rows
    pool = torch.empty(2, 4, bs, kvh, width, dtype=pool_dtype, device=meta_device)
    context = max(2, min(shape.max_model_len, 4 * bs))
    blocks = list(range(1, -(-context // bs) + 1))
    splits = [1] if shape.deterministic else backend.split_counts(kvh, shape.max_model_len)
    # the scratch the engine prepared, or (enumerating without an engine) one shaped like it, on meta
    saved = backend.scratch
    if saved is None or not saved.fits(h, d, meta_device):
        backend.scratch = ops.SplitScratch(2 * max(splits), h, d, meta_device)
    try:
        with record_launches(dry=True) as launches:
            for count in splits:
                meta = PagedAttentionMetadata.build([1, 2], [context, context], [blocks, blocks], bs,
                                                    device=meta_device, backend=backend,
                                                    deterministic=shape.deterministic, kv_format=shape.kv_format)
                for launch in backend.plan(meta, h, kvh, d):  # kept on ``meta``: the forward takes this plan
                    launch.num_splits = count
                backend.forward(query, key, value, pool[0], pool[1], meta, d ** -0.5)
    finally:
        backend.scratch = saved
    return launches


def layer_launches(dtype: torch.dtype, hidden: int, intermediate: int, num_heads: int, kv_heads: int,
                   head_dim: int, vocab: int, qkv_bias: bool = False, deterministic: bool = False,
                   rotary_dim: int | None = None, max_positions: int = 4096) -> list[Launch]:
    """The layer ops a Llama-family decoder (llama, qwen2) launches at these widths (one rank), dry
    over meta tensors: RMSNorm alone and with the residual, neox rotary on the fused qkv output's
    views, SiLU-and-multiply, and under ``deterministic`` the batch-invariant linear of every layer."""
    from kernels.triton.linear import linear_batch_invariant

    m = dict(dtype=dtype, device="meta")
    t = 3
    width = (num_heads + 2 * kv_heads) * head_dim
    with record_launches(dry=True) as launches:
        x, residual, weight = torch.empty(t, hidden, **m), torch.empty(t, hidden, **m), torch.empty(hidden, **m)
        ops.rms_norm(x, weight, 1e-6)
        ops.fused_add_rms_norm(x, residual, weight, 1e-6)
        qkv = torch.empty(t, width, **m)
        positions = torch.empty(t, dtype=torch.long, device="meta")
        cache = torch.empty(max_positions, rotary_dim or head_dim, dtype=torch.float32, device="meta")
        ops.rotary_neox_(positions, qkv[:, :num_heads * head_dim],
                         qkv[:, num_heads * head_dim:(num_heads + kv_heads) * head_dim], cache, head_dim)
        ops.silu_and_mul(torch.empty(t, 2 * intermediate, **m))
        if deterministic:
            for n, k, bias in ((width, hidden, qkv_bias), (hidden, num_heads * head_dim, False),
                               (2 * intermediate, hidden, False), (hidden, intermediate, False),
                               (vocab, hidden, False)):
                linear_batch_invariant(torch.empty(t, k, **m), torch.empty(n, k, **m),
                                       torch.empty(n, **m) if bias else None)
    return launches


def moe_launches(dtype: torch.dtype, hidden: int, intermediate: int, num_experts: int, top_k: int,
                 deterministic: bool = False) -> list:
    """The fused-MoE launches of one rank at these widths, dry over meta tensors (the compile check):
    gate|up and down."""
    m = dict(device="meta")
    t = 3
    pairs = t * top_k
    rows = max_blocks(pairs, num_experts) * BLOCK_M
    sorted_ids = torch.empty(rows, dtype=torch.int32, **m)
    block_expert = torch.empty(rows // BLOCK_M, dtype=torch.int32, **m)
    num_post = torch.empty(1, dtype=torch.int32, **m)
    weights = torch.empty(pairs, dtype=torch.float32, **m)
    with record_launches(dry=True) as launches:
        moe_gemm(torch.empty(t, hidden, dtype=dtype, **m), torch.empty(num_experts, 2 * intermediate, hidden,
                 dtype=dtype, **m), torch.empty(pairs, 2 * intermediate, dtype=dtype, **m), weights, sorted_ids,
                 block_expert, num_post, pairs, top_k, False, False, deterministic)
        moe_gemm(torch.empty(pairs, intermediate, dtype=dtype, **m), torch.empty(num_experts, hidden, intermediate,
                 dtype=dtype, **m), torch.empty(pairs, hidden, dtype=torch.float32, **m), weights, sorted_ids,
                 block_expert, num_post, pairs, top_k, True, True, deterministic)
    return launches


# --- compiling --------------------------------------------------------------------------------------

def compile_variants(backend: TritonAttentionBackend, shape: AttentionShape,
                     forward: Callable[[], object] | None = None) -> dict:
    """Compile every variant an engine of ``shape`` can launch, before it serves: ``forward`` (a small
    forward of the model: the layer ops at its widths, launched) and then each enumerated attention
    variant through Triton's ``warmup`` (compiled for the current device, not launched; a later
    launch of the same variant finds it in Triton's cache). Under the interpreter nothing compiles
    (``warmup`` does nothing there) but the same calls run. Returns what was done."""
    start = time.perf_counter()
    if forward is not None:
        forward()
    forward_s = time.perf_counter() - start
    variants = distinct(attention_launches(backend, shape))
    for launch in variants.values():
        launch.kernel.warmup(*launch.args, grid=launch.grid, **launch.constexprs)
    return {"attention_variants": len(variants), "forward_s": forward_s,
            "seconds": time.perf_counter() - start, "compiled": not ops.INTERPRETED}


def compile_for_target(launch: Launch, target):
    """Compile ``launch``'s variant for ``target`` (a ``triton.backends.compiler.GPUTarget``) with
    no device: Triton's own binder and compiler, as a launch on that target would."""
    from triton.compiler import ASTSource, make_backend
    from triton.compiler import compile as triton_compile
    from triton.runtime.jit import create_function_from_signature

    fn = _jit(launch.kernel)
    backend = make_backend(target)
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound, specialization, options = binder(*launch.args, **launch.constexprs)
    options, signature, constexprs, attrs = fn._pack_args(backend, dict(launch.constexprs), bound, specialization,
                                                          options)
    return triton_compile(ASTSource(fn, signature, constexprs, attrs), target=target, options=options.__dict__)


# --- the model runner's calls -----------------------------------------------------------------------

def runner_shape(runner) -> AttentionShape:
    """The attention shape of a ``workers.model_runner.ModelRunner``'s configuration (its rank)."""
    config, spec = runner.config, runner.kv_spec
    return AttentionShape(
        dtype=runner.dtype, num_heads=config.model.hf_config["num_attention_heads"] // runner.tp.size,
        kv_heads=spec.num_kv_heads, head_dim=spec.head_dim, block_size=runner.block_size,
        max_decodes=runner._max_decodes(), max_model_len=config.max_model_len, deterministic=config.deterministic,
        kv_format=spec.kv_format)


def prepare_runner(runner) -> None:
    """At the runner's start, before its memory profile: the backend's split-KV scratch."""
    runner.attention_backend.prepare(runner_shape(runner), runner.device)


def warm_up_runner(runner) -> dict:
    """After the KV pool exists, before the engine reports ready: every variant compiled, the layer
    ops by one prefill of up to 16 tokens and its logits, on a throwaway pool (the runner's
    ``_throwaway_forward``, which its warm-up and profile runs share)."""
    sched = runner.config.scheduler
    n = max(1, min(16, sched.max_num_batched_tokens, runner.config.max_model_len))
    blocks = list(range(1, -(-n // runner.block_size) + 1))

    def forward():
        with torch.inference_mode():
            runner._throwaway_forward([n], [n], [blocks], torch.arange(n, device=runner.device))

    backend = runner.attention_backend
    if backend.shape is None:
        raise RuntimeError("compiling the Triton variants needs the backend prepared (prepare_runner) first")
    done = compile_variants(backend, backend.shape, forward)
    if runner.tp.is_first_rank:
        logger.info("Triton: %d attention variants and the layer ops %s in %.1f s", done["attention_variants"],
                    "compiled" if done["compiled"] else "enumerated (interpreted: nothing to compile)",
                    done["seconds"])
    return done
