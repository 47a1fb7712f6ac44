"""Starting where the compiled CPU kernels are not built yet, or cannot be: an empty kernel cache (a
new node) that two processes start on at once, no compiler, a failed build, a compiler whose OpenMP
does not match torch's; and the built library on torch's own OpenMP runtime."""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from kernels.cpu.build import BuildError, build, load, load_error, openmp_flags, openmp_runtime
from tests.compiled import threads
from tests.conftest import HFOracle

ROOT = Path(__file__).resolve().parents[2]
GENERATE = textwrap.dedent("""
    import json, logging, sys
    logging.basicConfig(level=logging.INFO, stream=sys.stderr)
    from engine import LLM, SamplingParams
    prompts = json.loads(sys.argv[2])
    with LLM(model=sys.argv[1]) as llm:  # attention_backend "auto", as a user starts it
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
        print(json.dumps({"backend": llm.stats()["attention_backend"],
                          "tokens": [o.outputs[0].token_ids for o in outs]}))
""")
PROMPTS = [[1, 57, 300, 12, 9], [1, 400, 401, 402, 403, 404, 405, 406, 407, 408, 409]]


def _env(cache: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("CXX", "KVSERVE_CPU_ARCH")}
    env.update(KVSERVE_KERNEL_CACHE=str(cache), PYTHONPATH=str(ROOT), **extra)
    return env


def _generate(model: str, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", GENERATE, model, json.dumps(PROMPTS)], env=env, cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1]), err


def _check_tokens(model: str, tokens: list[list[int]]) -> None:
    oracle = HFOracle(model)
    for prompt, out in zip(PROMPTS, tokens):
        oracle.assert_greedy(prompt, out)


AVX2 = "avx2" in Path("/proc/cpuinfo").read_text()


@pytest.fixture(scope="module")
def second_build(tmp_path_factory) -> dict[str, str]:
    """An empty kernel cache, and the target its build is for: AVX2 without AVX-512 (x86-64-v3) where
    this CPU has AVX2, so that the build the first start makes here is the 8-lane code that servers
    without AVX-512 run (this machine's own build, from ``make install``, has its widest vectors)."""
    return {"KVSERVE_KERNEL_CACHE": str(tmp_path_factory.mktemp("kernels")),
            **({"KVSERVE_CPU_ARCH": "x86-64-v3"} if AVX2 else {})}


def test_an_empty_cache_is_built_once_for_two_processes_that_start_together(model_dirs, second_build):
    """A new node: two engines start at once on an empty kernel cache. One builds (in a child
    process, so its own process maps the library once), the other waits on the lock; both load it,
    generate on the compiled kernels and give Hugging Face's tokens."""
    cache = Path(second_build["KVSERVE_KERNEL_CACHE"])
    assert not any(cache.iterdir())
    procs = [_generate(model_dirs["llama"], {**_env(cache), **second_build}) for _ in range(2)]
    results = [_finish(p) for p in procs]
    for result, _ in results:
        assert result["backend"] == "cpu"
        _check_tokens(model_dirs["llama"], result["tokens"])
    assert results[0][0]["tokens"] == results[1][0]["tokens"]
    # one built while the other waited on the lock (not one after the other)
    logs = sorted(("building the CPU kernels" in log, "waiting for another process's build" in log)
                  for _, log in results)
    assert logs == [(False, True), (True, False)], logs
    builds = list(cache.iterdir())
    assert len(builds) == 1 and (builds[0] / "kvserve_cpu.so").exists() and (builds[0] / "build.log").exists()


def test_no_compiler_runs_the_torch_kernels_with_the_reason_in_the_log(model_dirs, tmp_path):
    bin_dir = tmp_path / "bin"  # nothing on PATH: the build looks in the venv (ninja), which has no compiler
    bin_dir.mkdir()
    proc = _generate(model_dirs["llama"], _env(tmp_path / "kernels", PATH=str(bin_dir)))
    result, log = _finish(proc)
    assert result["backend"] == "torch"
    assert "compiled CPU kernels unavailable, the plain-torch kernels run instead: no C++ compiler: 'c++' is not on PATH" \
        in log
    assert "attention backend: torch (the compiled CPU kernels are unavailable: no C++ compiler" in log
    _check_tokens(model_dirs["llama"], result["tokens"])


def test_kernel_tests_skip_with_the_reason_where_the_kernels_cannot_be_built(tmp_path):
    """A machine with no compiler: the compiled kernels' test modules are skipped, naming why, instead
    of failing at collection."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs",
                           "tests/kernels/test_cpu_layer_ops.py", "tests/kernels/test_cpu_metadata_checks.py"],
                          env=_env(tmp_path / "kernels", PATH=str(bin_dir)), cwd=ROOT, capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 5, done.stdout[-3000:]  # no test collected (both modules skipped), not 2 (errors)
    assert "2 skipped" in done.stdout and "error" not in done.stdout.lower(), done.stdout[-3000:]
    assert "the compiled CPU kernels are unavailable here: no C++ compiler: 'c++' is not on PATH" in done.stdout


def _fake_compiler(directory: Path, script: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / "fake-c++"
    path.write_text("#!/bin/sh\n" + script)
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def test_a_failed_build_names_the_compilers_first_error(tmp_path, monkeypatch):
    compiler = _fake_compiler(tmp_path / "bin", 'if [ "$1" = --version ]; then echo "g++ (GCC) 12.2.0"; exit 0; fi\n'
                                                'echo "paged_attention.cpp:12:3: error: something is broken" >&2\n'
                                                "exit 1\n")
    monkeypatch.setenv("KVSERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CXX", str(compiler))
    with pytest.raises(BuildError) as failed:
        build()
    message = str(failed.value)
    assert message.startswith("the C++ build failed: ") and "error: something is broken" in message
    log = message.rsplit("(the whole log: ", 1)[1].rstrip(")")
    assert "error: something is broken" in Path(log).read_text()


def test_clang_beside_torchs_libgomp_is_refused_with_what_to_do(tmp_path, monkeypatch):
    runtime = openmp_runtime()
    if runtime is None or not runtime.name.startswith("libgomp"):
        pytest.skip(f"torch here runs on {runtime.name if runtime else 'no OpenMP runtime'}, not GCC's libgomp")
    compiler = _fake_compiler(tmp_path / "bin", 'echo "Debian clang version 14.0.6"\n')
    monkeypatch.setenv("KVSERVE_KERNEL_CACHE", str(tmp_path / "kernels"))
    monkeypatch.setenv("CXX", str(compiler))
    with pytest.raises(BuildError, match="is clang, whose OpenMP code needs LLVM's runtime, and torch here runs on "
                                         r"GCC's libgomp \(libgomp.*\): build with g\+\+ \(set CXX=g\+\+\)"):
        build()


def test_the_kernels_load_here_wherever_a_compiler_and_ninja_are_at_hand():
    """The kernel tests skip where the kernels cannot be built; wherever a compiler and ninja are at
    hand (CI's machines), they must load, so those skips cannot hide a broken build."""
    path = os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")])
    if not (shutil.which(os.environ.get("CXX", "c++").split()[0], path=path) and shutil.which("ninja", path=path)):
        pytest.skip("no C++ compiler or no ninja here")
    assert load() is not None, load_error()


RUNTIMES = textwrap.dedent("""
    import json, os, torch
    def runtimes():
        mapped = {line.split()[-1] for line in open("/proc/self/maps") if "/" in line}
        return sorted(p for p in mapped if os.path.basename(p).startswith(("libgomp", "libomp", "libiomp")))
    before = runtimes()
    from kernels.cpu import load
    assert load() is not None
    print(json.dumps([before, runtimes()]))
""")


def test_loading_the_kernels_brings_no_second_openmp_runtime():
    """A fresh process: the OpenMP runtimes mapped after ``import torch`` are the same ones after the
    kernels load (the library links torch's own, whatever name its wheel gave it)."""
    done = subprocess.run([sys.executable, "-c", RUNTIMES], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-2000:]
    before, after = json.loads(done.stdout.strip().splitlines()[-1])
    assert before and after == before, (before, after)


def test_torch_threads_reach_the_kernels():
    ops = load()
    for n in (1, 2, 3, 4, 8):
        with threads(n):
            assert ops.parallel_threads() == n


def test_openmp_flags_link_torchs_runtime():
    runtime = Path("/site/torch.libs/libgomp-a34b3233.so.1")
    assert openmp_flags("Linux", runtime) == (["-fopenmp"], [str(runtime), "-Wl,-rpath,/site/torch.libs"])
    assert openmp_flags("Darwin", Path("/site/torch/lib/libomp.dylib")) == (
        ["-Xpreprocessor", "-fopenmp"], ["/site/torch/lib/libomp.dylib", "-Wl,-rpath,/site/torch/lib"])
    assert openmp_flags("Linux", None) == (["-fopenmp"], ["-fopenmp"])


VEC_CHECK = textwrap.dedent("""
    #include <cstdio>
    #include "vec.h"
    using namespace kvserve;
    int main() {
      vf v[W];
      for (int i = 0; i < W; ++i)
        for (int j = 0; j < W; ++j) v[i][j] = static_cast<float>((i + 1) * (j % 3 + 1));
      const vf s = transpose_sum(v);
      for (int i = 0; i < W; ++i) std::printf("%g ", s[i]);
      std::printf("| %d\\n", W);
    }
""")


@pytest.mark.parametrize("arch", ["x86-64-v3", "native"])
def test_vec_h_builds_with_the_shuffles_of_gcc_before_12(arch, tmp_path):
    """GCC 11 (Ubuntu 22.04, RHEL 9) has no __builtin_shufflevector: vec.h's shuffles are built, with
    this g++ told it is GCC 11, from __builtin_shuffle, and sum a vector's lanes as the other path does."""
    if arch == "x86-64-v3" and not AVX2:
        pytest.skip("an AVX2 build runs on an x86-64 CPU with AVX2 only")
    source = tmp_path / "vec_check.cpp"
    source.write_text(VEC_CHECK)
    outputs = []
    builds = [["g++"], ["g++", "-U__GNUC__", "-D__GNUC__=11", "-Wno-builtin-macro-redefined"]]
    if shutil.which("g++-11"):  # GCC 11 itself where it is installed (Debian: apt-get install g++-11)
        builds.append(["g++-11"])
    for compiler, *extra in builds:
        binary = tmp_path / f"vec_check{len(outputs)}"
        subprocess.run([compiler, "-std=c++17", "-O2", f"-march={arch}", *extra, f"-I{ROOT / 'kernels' / 'cpu'}",
                        str(source), "-o", str(binary)], check=True, capture_output=True, text=True)
        outputs.append(subprocess.run([str(binary)], check=True, capture_output=True, text=True).stdout)
    width = int(outputs[0].split("|")[1])
    sums = [float(x) for x in outputs[0].split("|")[0].split()]
    assert sums == [(i + 1) * sum(j % 3 + 1 for j in range(width)) for i in range(width)]
    assert all(out == outputs[0] for out in outputs[1:])
    if arch == "x86-64-v3":
        assert width == 8


def test_the_avx2_build_passes_the_kernel_tests(second_build):
    """This machine's build uses its widest vectors; servers without AVX-512 run the 8-lane code: the
    build for x86-64-v3 (AVX2, ``KVSERVE_CPU_ARCH``; the empty-cache test made it) runs the kernel
    tests in its own process."""
    if not AVX2:
        pytest.skip("an AVX2 build runs on an x86-64 CPU with AVX2 only")
    env = {**_env(Path(second_build["KVSERVE_KERNEL_CACHE"])), **second_build}
    width = subprocess.run([sys.executable, "-c", "from kernels.cpu import load; ops = load(); "
                            "print(ops.linear_panel_width(), ops.amx_usable())"],
                           env=env, cwd=ROOT, capture_output=True, text=True, timeout=900)
    # 2 x 8 lanes; no AMX product in a build for a target without AMX, whatever this CPU has
    assert width.returncode == 0 and width.stdout.split()[-2:] == ["16", "False"], width.stderr[-2000:]
    tests = ["tests/kernels/test_cpu_attention.py", "tests/kernels/test_cpu_layer_ops.py",
             "tests/kernels/test_cpu_metadata_checks.py", "tests/kernels/test_deterministic_kernels.py",
             "tests/kernels/test_cpu_envelope.py", "tests/kernels/test_cpu_moe.py",
             "tests/kernels/test_cpu_kv_quant.py", "tests/kernels/test_gemm_blocking.py"]
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *tests,
                           "-k", "not test_linear_at_real_widths or 896 or 1152 or 50272"],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=1200)
    assert done.returncode == 0, done.stdout[-4000:]
    assert " passed" in done.stdout and "skipped" not in done.stdout, done.stdout[-2000:]
