"""The benchmark scripts' bookkeeping (timing itself needs the device)."""

from __future__ import annotations

import csv
import importlib
import json
import os
import pathlib
import pkgutil
import subprocess
import sys
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import benchmarks
from benchmarks import (accuracy, attention, breakdown, compile_time, quantize, scaling,
                        variants)

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCRIPTS = sorted(m.name for m in pkgutil.iter_modules(benchmarks.__path__)
                 if hasattr(importlib.import_module(f"benchmarks.{m.name}"), "main"))


def test_every_script_is_a_module_listed_in_the_benchmarks_readme():
  """Each script imports as `benchmarks.<name>` (absolute imports only) and
  benchmarks/README.md gives its `python -m` command."""
  assert "attention" in SCRIPTS and "variants" not in SCRIPTS
  readme = (ROOT / "benchmarks" / "README.md").read_text()
  missing = [n for n in SCRIPTS if f"python -m benchmarks.{n}" not in readme]
  assert not missing, f"benchmarks/README.md has no command for {missing}"


def test_a_script_runs_from_the_root_without_pythonpath():
  env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
  run = subprocess.run([sys.executable, "-m", "benchmarks.breakdown", "--help"], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stderr
  assert "--impls" in run.stdout


def _plane(name, lines):
  event = lambda name, ns: SimpleNamespace(name=name, duration_ns=ns)
  return SimpleNamespace(name=name, lines=[
      SimpleNamespace(name=line, events=[event(*e) for e in events])
      for line, events in lines.items()])


def _row(impl, fwd_tops, peak=None):
  row = dict(impl=impl, B=4, T=4096, H=16, D=128, causal=False, fwd_tops=fwd_tops,
             fwd_bwd_tops=200.0)
  if peak is not None:
    row["fwd_bwd_peak_gib"] = peak
  return row


def test_write_csv_takes_the_union_of_keys(tmp_path):
  rows = [dict(impl="a", ms=1.5), dict(impl="b", ms=2.0, dq_rel=1e-4)]
  attention.write_csv(rows, str(tmp_path / "new"), "x.csv")
  with open(tmp_path / "new" / "x.csv", newline="") as f:
    read = list(csv.DictReader(f))
  assert [r["impl"] for r in read] == ["a", "b"]
  assert read[0]["dq_rel"] == "" and float(read[1]["dq_rel"]) == 1e-4


def test_table_has_one_full_line_per_row_with_ratios():
  rows = [_row("cudnn", 500.0, peak=0.56), _row("sage", 250.0)]
  attention._ratios(rows)
  lines = attention._table(rows).splitlines()[2:]
  assert len(lines) == 2
  cudnn, sage = (line.split("|")[1:-1] for line in lines)
  assert len(cudnn) == len(sage) == 11
  assert sage[0].strip() == "sage" and float(sage[7]) == 0.5  # 250 / 500
  assert cudnn[-1].strip() == "0.56" and sage[-1].strip() == "-"


def test_kernel_times_sum_stream_kernels_per_call():
  planes = [
      _plane("/host:CPU", {"python": [("fwd", 9e6)]}),
      _plane("/device:GPU:0", {
          "Stream #13(compute)": [("fwd", 1e6), ("quantize", 2e5), ("fwd", 3e6)],
          "Stream #14(memcpy)": [("quantize", 2e5)],
          "XLA Ops": [("fusion.1", 4e6)],  # a summary of the same time
      }),
  ]
  times = breakdown.kernel_times(planes, iters=2)
  assert times == {"fwd": (2e-3, 1.0), "quantize": (2e-4, 1.0)}
  report = breakdown.report("x", times)
  assert report[0] == "x: 2.200 ms of kernels per call"
  assert report[1].split()[:2] == ["2.000", "ms"] and report[1].endswith("fwd")
  assert breakdown.report("x", {}) == ["x: no GPU kernels in the trace"]


def test_variant_flags_pick_known_variants(monkeypatch):
  known = {"a": 1, "b": 2}
  monkeypatch.setattr(benchmarks, "require_gpu", lambda module: None)
  monkeypatch.setattr(sys, "argv", ["x", "--seq", "128", "--variants", "b"])
  args, names = variants.parse_args("doc", "benchmarks.x", known)
  assert args.seq == 128 and names == ["b"]
  monkeypatch.setattr(sys, "argv", ["x"])
  assert variants.parse_args("doc", "benchmarks.x", known)[1] == ["a", "b"]
  monkeypatch.setattr(sys, "argv", ["x", "--variants", "a,c"])
  with pytest.raises(SystemExit):  # argparse's error: names the unknown variant
    variants.parse_args("doc", "benchmarks.x", known)


@pytest.mark.parametrize("sigmas", ["2", "1,x", ""])
def test_accuracy_refuses_sigmas_outside_table_1(monkeypatch, capsys, sigmas):
  monkeypatch.setattr(sys, "argv", ["x", "--sigmas", sigmas])
  with pytest.raises(SystemExit):
    accuracy.main()
  assert "--sigmas" in capsys.readouterr().err


def test_variant_rows_carry_tops_and_the_ratio_to_cudnn():
  args = SimpleNamespace(batch=1, seq=64, heads=2, head_dim=64)
  table = variants.Rows(args, width=8)
  cudnn = table.record("cudnn", 1e-3, causal=False, flops=4e12)
  ours = table.record("ours", 2e-3, causal=False, flops=4e12, err=1e-4)
  other = table.record("ours", 1e-3, causal=True, flops=2e12)
  table.ratios(False, cudnn)
  assert (cudnn["tops"], ours["tops"]) == (4000.0, 2000.0)
  assert ours["x_cudnn"] == 0.5 and ours["err"] == 1e-4 and ours["T"] == 64
  assert "x_cudnn" not in other  # only the ratios of the reference's causality
  assert [x.shape for x in variants.random_inputs(args, 2)] == [(1, 64, 2, 64)] * 2


def test_profile_reads_back_its_own_trace():
  """On the CPU the trace has no GPU plane: no kernels, but a trace was written and read."""
  fn = jax.jit(lambda x: jnp.sin(x) @ x)
  assert breakdown.profile(fn, (jnp.ones((64, 64)),), iters=2) == {}


def test_mosaic_profile_reads_regions_per_warpgroup():
  """Warpgroups' traces as Mosaic GPU's profiler writes them (ts: ns +
  cycles, / 1000): each region's cycles per occurrence, and each compute
  warpgroup's span from its first bound to its last; the producer's trace
  (only the kernel's start region) left out."""
  from benchmarks import mosaic_profile
  events = [dict(name=name, ph=ph, ts=ts / 1e3, tid=tid) for tid, name, ph, ts in [
      (1, "Init", "B", 0), (1, "Init", "E", 90),
      (1, "s_dp", "B", 100), (1, "s_dp", "E", 400), (1, "elementwise", "B", 400),
      (1, "elementwise", "E", 1000), (2, "Init", "B", 0), (2, "Init", "E", 40),
      (2, "s_dp", "B", 50), (2, "s_dp", "E", 150), (3, "Init", "B", 0), (3, "Init", "E", 700)]]
  cycles = mosaic_profile.region_cycles({"traceEvents": events})
  np.testing.assert_allclose(cycles["s_dp"], [300, 100])
  np.testing.assert_allclose(cycles["elementwise"], [600])
  np.testing.assert_allclose(cycles["Init"], [90, 40])
  np.testing.assert_allclose(sorted(cycles["loop"]), [150, 1000])


def test_mosaic_profile_counts_steps_without_the_nested_tile_waits(tmp_path, capsys):
  """A tile wait nests in its step's issue region and one more runs before
  the loop: two steps, not three, of (1000 - 0) / 2 cycles."""
  import json
  from benchmarks import mosaic_profile
  bounds = [("tiles_s", 0, 50), ("issue", 100, 400), ("tiles_s", 150, 250),
            ("issue", 500, 800), ("tiles_s", 520, 540), ("elementwise", 800, 1000)]
  events = [dict(name=name, ph=ph, ts=ts / 1e3, tid=1)
            for name, begin, end in sorted(bounds, key=lambda b: (b[1], -b[2]))
            for ph, ts in (("B", begin), ("E", end))]
  events.sort(key=lambda e: (e["ts"], e["ph"] == "B"))
  (tmp_path / "k-trace.json").write_text(json.dumps({"traceEvents": events}))
  mosaic_profile.report("k", str(tmp_path))
  out = capsys.readouterr().out
  assert "1 compute warpgroups, 2.0 steps each, 500 cycles a step" in out
  assert "tiles_s            57 cycles x   3.0" in out  # (50 + 100 + 20) / 3


def test_compile_time_measures_a_train_step_in_a_fresh_process():
  """`--part step`'s child builds train's step as `train` does, in a
  subprocess, and reports its trace, lowering and compile apart."""
  t = compile_time._child("step", attention="sage", preset="tiny", seq=64, batch=2)
  assert t.trace_s > 0 and t.lower_s > 0 and t.compile_s > 0
  assert not t.alarm


def test_key_mean_candidate_is_key_means_mean():
  """The quantization benchmark's candidate for K's mean, against float64."""
  k = jax.random.normal(jax.random.key(0), (2, 256, 3, 64), jnp.bfloat16) * 4 + 3
  want = np.mean(np.asarray(k, np.float64), axis=1)
  np.testing.assert_allclose(quantize.key_mean_by_blocks(k), want, rtol=1e-6)


LISTING = """
.L_x_1:
\t//## File "/x/backward_dkdv.py", line 90
        /*0100*/                   IGMMA.64x64x32.S8.S8 R24, R8, gdesc[UR4], RZ ;
\t//## File "/x/backward_common.py", line 140
        /*0110*/                   FFMA R2, R3, R4, R2 ;
        /*0120*/              @!P0 BRA `(.L_x_1) ;
.L_x_2:
        /*0130*/                   F2FP.BF16.F32.PACK_AB R5, R6, R7 ;
        /*0140*/               @P1 BRA `(.L_x_2) ;
        /*0150*/                   BRA `(.L_x_1) ;
        /*0160*/                   EXIT ;
"""


def test_sass_finds_the_innermost_wgmma_loop():
  """The loop that issues a wgmma is found with its source lines; a loop
  without one and a branch from the epilogue back into the loop are not."""
  from benchmarks import sass
  instructions, labels = sass.parse_listing(LISTING)
  assert [i.opcode for i in instructions[:3]] == ["IGMMA.64x64x32.S8.S8", "FFMA", "BRA"]
  assert instructions[1].line == "backward_common.py:140"
  assert sass.wgmma_loops(instructions, labels) == [range(0, 3)]


def test_sass_keeps_ptxas_registers_spills_warnings_and_advisories():
  """ptxas prints its wgmma advisories as info lines (these two from ptxas
  13.0 on a chain whose accumulator is copied between two wgmmas)."""
  from benchmarks import sass
  report = """ptxas info    : (C7519) warpgroup.arrive is injected in around line 74 by compiler to allow use of registers in GMMA in function 'k'
ptxas info    : (C7517) warpgroup.wait is injected in around line 74 by compiler to allow use of registers defined by GMMA in function 'k'
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function 'k' for 'sm_90a'
ptxas warning : Unresolved extern function 'f'
ptxas info    : Function properties for k
    0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers"""
  kept = [row.strip() for row in sass.ptxas_summary(report).splitlines()]
  assert [row.split(" : ")[0].strip() for row in kept] == [
      "ptxas info", "ptxas info", "ptxas warning",
      "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", "ptxas info"]
  assert "(C7519)" in kept[0] and "(C7517)" in kept[1] and "168 registers" in kept[4]


def test_sass_counts_a_loop_per_score_and_refuses_missing_files(capsys, tmp_path):
  from benchmarks import sass
  instructions, labels = sass.parse_listing(LISTING)
  sass.report_loops(instructions, labels, scores_per_thread=1.5, lines=2)
  out = capsys.readouterr().out
  assert "loop of 3 instructions = 2.0 per score (0 spill loads/stores)" in out
  assert "1 wgmmas, 0 waits for them, 0 fences" in out
  assert " 1.33/score    2 backward_common.py:140: FFMA 1, BRA 1" in out
  assert " 0.67/score    1 backward_dkdv.py:90: IGMMA.64x64x32.S8.S8 1" in out
  for argv in ([], [str(tmp_path / "absent.ptx")]):
    with pytest.raises(SystemExit):
      sass.main(argv)
  assert "absent.ptx" in capsys.readouterr().err


def test_programs_per_sm_counts_registers_in_warp_units():
  """64K registers per SM, allocated per warp in units of 256: a 4-warp
  program fits three times up to 168 registers a thread, twice from 169."""
  from benchmarks import sass
  assert sass.programs_per_sm(167, 128) == sass.programs_per_sm(168, 128) == 3
  assert sass.programs_per_sm(169, 128) == sass.programs_per_sm(207, 128) == 2
  assert sass.programs_per_sm(255, 256) == 1
  assert sass.programs_per_sm(128, 128) == 4


@pytest.mark.parametrize("script", SCRIPTS)
def test_help_shows_the_whole_docstring_and_every_choice(script, monkeypatch, capsys):
  module = importlib.import_module(f"benchmarks.{script}")
  monkeypatch.setattr(sys, "argv", [script, "--help"])
  with pytest.raises(SystemExit) as e:
    module.main()
  assert e.value.code == 0
  out = capsys.readouterr().out
  assert f"python -m benchmarks.{script}" in out.splitlines()[0]  # usage: its command
  assert " ".join(module.__doc__.split()) in " ".join(out.split())  # no sentence cut
  if script in ("attention", "breakdown"):
    assert all(name in out for name in attention.IMPLEMENTATIONS)


@pytest.mark.skipif(jax.default_backend() == "gpu", reason="the refusal is for machines "
                    "without a GPU")
@pytest.mark.parametrize("script,flags", [("attention", ["--quick"]), ("breakdown", []),
                                          ("tune", []), ("train_step", []),
                                          ("dq_reduce", []), ("quantize", [])])
def test_gpu_benchmarks_refuse_without_a_gpu(script, flags, monkeypatch):
  module = importlib.import_module(f"benchmarks.{script}")
  monkeypatch.setattr(sys, "argv", [script, *flags])
  with pytest.raises(SystemExit, match=f"benchmarks.{script} times GPU kernels, and jax "
                                       f"sees no GPU"):
    module.main()


def test_scaling_names_each_attention_kernel_by_backend():
  found = {"sagebwd_forward_mosaic": 1, "sagebwd_backward_dq_mosaic": 1,
           "sagebwd_backward_dkdv_mosaic": 1, "sagebwd_triton_quantize": 1,
           "sagebwd_triton_backward_prepass": 1}
  assert scaling.roles(found) == [("backward_dkdv", "mosaic"), ("backward_dq", "mosaic"),
                                  ("forward", "mosaic")]
  fallback = {"sagebwd_triton_forward": 1, "sagebwd_triton_backward_dq": 1,
              "sagebwd_triton_backward_dkdv": 1}
  assert {backend for _, backend in scaling.roles(fallback)} == {"triton"}
  assert scaling.devices_of("data=2,model=2") == 4 and scaling.devices_of("model=2") == 2


@pytest.mark.parametrize("flags,message", [
    (["--meshes", "data=two"], "--meshes: --mesh 'data=two': size of 'data' must be an integer"),
    ([], "needs 2 GPUs for --meshes data=2,model=1 data=1,model=2; jax sees 0 here"),
])
def test_scaling_refuses_bad_meshes_and_too_few_gpus(flags, message, monkeypatch, tmp_path):
  monkeypatch.setattr(scaling, "gpu_count", lambda: 0)
  monkeypatch.setattr(sys, "argv", ["x", "--out", str(tmp_path), *flags])
  with pytest.raises(SystemExit, match=message):
    scaling.main()


def test_scaling_run_reads_its_last_losses_and_tokens_per_gpu(monkeypatch, tmp_path):
  """The child's command and GPUs, and its metrics read back: the last train
  and eval rows, the median tokens/s past the first steps, per GPU."""
  calls = []

  def fake_train(cmd, env, check):
    calls.append((cmd, env["CUDA_VISIBLE_DEVICES"]))
    out = pathlib.Path(cmd[cmd.index("--out") + 1])
    out.mkdir(parents=True)
    rows = [dict(step=0, tokens=0, val_loss=5.0)]
    rows += [dict(step=i, tokens=i, loss=4.0 - i / 10, lr=1e-3,
                  tokens_per_s=1e9 if i <= 5 else 400.0 + i) for i in range(1, 9)]
    rows += [dict(step=8, tokens=8, val_loss=3.5)]
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

  monkeypatch.setattr(scaling.subprocess, "run", fake_train)
  args = SimpleNamespace(out=str(tmp_path), preset="tiny", steps=8, seed=3)
  r = scaling.train("data2-model1", 2, "data=2,model=1", args, ["--lr", "1e-3"])
  (cmd, visible), = calls
  assert visible == "0,1" and cmd[-2:] == ["--mesh", "data=2,model=1"]
  assert {"--attention", "sage", "--seed", "3", "--lr", "1e-3"} <= set(cmd)
  assert r["loss"] == pytest.approx(3.2) and r["val_loss"] == 3.5
  assert r["per_gpu"] == pytest.approx(407.0 / 2)  # steps 6-8: 406, 407, 408


def test_scaling_kernels_keeps_the_ops_kernels_in_ms(monkeypatch):
  monkeypatch.setattr(breakdown, "profile", lambda fn, args, iters: {
      "sagebwd_forward_mosaic": (2e-3, 1.0), "nvjet_gemm": (5e-3, 2.0)})
  found = scaling.kernels("data=1,model=1", SimpleNamespace(preset="tiny"))
  assert found == {"sagebwd_forward_mosaic": (2.0, 1.0)}


def test_scaling_refuses_to_reuse_a_run_folder(monkeypatch, tmp_path):
  (tmp_path / "data2-model1").mkdir()
  (tmp_path / "data2-model1" / "metrics.jsonl").write_text("")
  monkeypatch.setattr(scaling, "gpu_count", lambda: 2)
  monkeypatch.setattr(sys, "argv", ["x", "--out", str(tmp_path)])
  with pytest.raises(SystemExit, match="already there: .*data2-model1"):
    scaling.main()
  assert (tmp_path / "data2-model1" / "metrics.jsonl").exists()


def test_the_deprecated_pallas_attention_is_imported_only_when_asked_for():
  code = ("import sys, benchmarks.attention, benchmarks.breakdown; "
          "assert 'jax.experimental.pallas.ops.gpu.attention' not in sys.modules")
  run = subprocess.run([sys.executable, "-W", "error::DeprecationWarning", "-c", code],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
  assert run.returncode == 0, run.stderr[-2000:]


def test_mosaic_ptx_refuses_a_missing_plugin_and_non_fp8_variants(capsys, tmp_path):
  from benchmarks import mosaic_ptx
  plugin = tmp_path / "xla_cuda_plugin.so"
  with pytest.raises(SystemExit, match="--plugin: no file"):
    mosaic_ptx.main(["--plugin", str(plugin), "--out", str(tmp_path)])
  plugin.write_bytes(b"")
  for variants, forward in (("mosaic", []), ("mosaic_fp8,nope", []), ("mosaic_fp8_3st", ["--forward"])):
    with pytest.raises(SystemExit, match="--variants: '(mosaic|nope|mosaic_fp8_3st)' is not one"):
      mosaic_ptx.main(["--plugin", str(plugin), "--out", str(tmp_path), "--variants", variants,
                       *forward])


def test_mosaic_ptx_builds_each_fp8_kernel_on_abstract_inputs():
  """The kernels `benchmarks.mosaic_ptx` lowers: a backward variant's dK/dV
  and dQ on the benchmark's arguments (the FP8 operands last), a forward
  variant's kernel on its E4M3 V^T, and an unknown variant refused."""
  from benchmarks import mosaic_ptx
  shapes = [jax.ShapeDtypeStruct((1, 256, 2, 128), jnp.bfloat16)] * 4
  (dkdv, dkdv_args), (dq, dq_args) = mosaic_ptx.backward_kernels("mosaic_fp8_overlap", shapes,
                                                                 causal=True)
  assert (len(dkdv_args), len(dq_args)) == (8, 6)
  assert type(dkdv_args[-1]).__name__ == type(dq_args[-1]).__name__ == "Fp8Operands"
  assert dkdv_args[0].q8.shape == (1, 2, 256, 128) and dkdv_args[0].q8.dtype == jnp.int8
  [(forward, (qkv,))] = mosaic_ptx.forward_kernels("mosaic_fp8", shapes, causal=False)
  assert qkv.v8_t.dtype == jnp.float8_e4m3fn
  with pytest.raises(KeyError):
    mosaic_ptx.forward_kernels("mosaic_fp8_nope", shapes, causal=False)


def test_dkdv_ceiling_streams_the_kernels_step_and_lowers_each_part():
  """`benchmarks.dkdv_ceiling`'s step: Q8, Q8^T, dO8^T (a byte each), dO (two)
  and three fp32 row vectors per 64 queries at D=128; its CTA lowers for
  CUDA with each part, multicast, a longer chain and issue turns, and
  refuses an unknown part or cluster."""
  from benchmarks import dkdv_ceiling
  from conftest import assert_lowers_to_mosaic_gpu
  assert dkdv_ceiling.step_bytes() == 64 * 128 * 5 + 3 * 64 * 4 == 40.75 * 1024
  operands = jax.eval_shape(lambda: dkdv_ceiling.operands(1, 2, 512))
  for mode, cluster, chain, turns in [("stream", 1, 0, False), ("products", 1, 0, False),
                                      ("both", 2, 0, False), ("both", 1, 3, True)]:
    assert_lowers_to_mosaic_gpu(dkdv_ceiling.ceiling_call(
        mode, batch=1, heads=2, seq=512, slots=2, cluster=cluster, chain=chain,
        issue_turns=turns), *operands)
  with pytest.raises(ValueError, match="mode"):
    dkdv_ceiling.ceiling_call("chain", batch=1, heads=2, seq=512, slots=2, cluster=1)
  with pytest.raises(ValueError, match="cluster"):
    dkdv_ceiling.ceiling_call("both", batch=1, heads=2, seq=512, slots=2, cluster=4)
