"""`python -m train [--preset tiny] [flags]`: pre-train, then plot the run.

Every error a user can act on (a flag out of range, a run folder in the way,
a checkpoint or file that cannot be written) ends the run with one line
naming the flag, file or checkpoint, and exit status 1. SIGINT (Ctrl-C) and
SIGTERM save the last completed step and end it with one line saying how to
resume, exit status 128 + the signal (train/stop.py).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shlex
import shutil
import sys
import time

from train.cli import parse
from train.config import GPU_PRESETS, to_json
from train.stop import Interrupted, Stop, exit_status, handling, say


def _summary(result: dict, seconds: float, png: str, cache=None) -> str:
  fmt = lambda x: "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.4f}"
  mfu = "" if result.get("mfu") is None else f", MFU {result['mfu']:.1%}"
  cached = ("" if cache is None else
            f"; compile cache: {cache.hits} programs loaded, {cache.writes} written")
  speed = ("" if result["tokens_per_s"] is None else
           f"; {result['tokens_per_s']:,.0f} tokens/s{mfu} ({result['compile_s']:.0f}s of "
           f"compilation not counted{cached})")
  return (f"done in {seconds:.0f}s: step {result['step']}, loss {fmt(result['loss'])}, "
          f"val_loss {fmt(result['val_loss'])}{speed}; plot {png}")


def _refuse_gpu_presets_without_a_gpu(preset: str, cfg) -> None:
  """SystemExit with one line when `preset` is sized for GPUs and jax sees
  none (before the data, the run folder or the compile cache is touched)."""
  import jax
  if preset not in GPU_PRESETS or jax.default_backend() != "cpu":
    return
  from train.flops import cpu_refusal, measured_flops
  raise SystemExit(f"error: {cpu_refusal(cfg, preset, measured_flops(cfg.dtype))}")


def _compile_cache(flag: str | None, log) -> None:
  """jax's persistent compilation cache as --compile-cache asks
  (train/compile_cache.py); one line says where."""
  from train import compile_cache
  path = compile_cache.resolve(flag)
  if path is None:
    compile_cache.disable()
    return
  try:
    compile_cache.enable(path)
  except ValueError as e:
    if flag is not None:
      raise SystemExit(f"error: {e}")
    log(f"warning: {e}")  # the default folder: run without the cache
    compile_cache.disable()
    return
  log(f"compile cache: {path} (--compile-cache DIR moves it, --compile-cache none turns it off)")


def resume_command(argv: list[str], run_dir: str | None) -> str:
  """The command that continues the run in `run_dir`: `argv` less --out,
  --overwrite and --resume, then --out RUN_DIR --resume; with no run folder
  yet (None), the command as given."""
  python = shutil.which("python")
  same = python is not None and os.path.abspath(python) == os.path.abspath(sys.executable)
  head = ["python" if same else sys.executable, "-m", "train"]
  if run_dir is None:
    return shlex.join(head + argv)
  dropped = {"--overwrite", "--no-overwrite", "--resume", "--no-resume"}
  args, skip = [], False
  for arg in argv:
    if skip or arg in dropped or arg.startswith("--out="):
      skip = False
    elif arg == "--out":
      skip = True  # and its value
    else:
      args.append(arg)
  return shlex.join(head + args + ["--out", run_dir, "--resume"])


def main(argv: list[str] | None = None, stop: Stop | None = None) -> None:
  """`python -m train argv`; `stop`: the signals' stop requests, if handled
  (`__main__` below; `train.loop.train` then raises Interrupted)."""
  from train.rundir import RunError
  try:
    cfg, preset, options = parse(argv)
  except (RunError, ValueError) as e:
    raise SystemExit(f"error: {e}")
  if options["print_config"]:
    from train.rundir import resolve
    try:
      print(to_json(dataclasses.replace(cfg, out=resolve(cfg))))
    except RunError as e:
      raise SystemExit(f"error: {e}")
    return
  from train.sharding import initialize_distributed
  try:
    initialize_distributed(cfg.coordinator, cfg.num_processes, cfg.process_id)
  except ValueError as e:
    raise SystemExit(f"error: {e}")
  if not options["allow_cpu"]:
    # A resumed run is the saved one, whatever --preset says; its name is its
    # preset's unless --name gave another.
    _refuse_gpu_presets_without_a_gpu(cfg.name if cfg.resume else preset, cfg)
  import jax
  _compile_cache(options["compile_cache"],
                 (lambda line: print(line, file=sys.stderr)) if jax.process_index() == 0
                 else (lambda line: None))
  from train.loop import train  # after argument parsing: jax is slow to import
  from train.plot import plot

  t0 = time.perf_counter()
  try:
    result = train(cfg, stop=stop)
  except (RunError, ValueError) as e:
    raise SystemExit(f"error: {e}")
  if jax.process_index() != 0:
    return  # process 0 writes the plot and the summary
  try:
    png = plot([result["run_dir"]], os.path.join(result["run_dir"], "loss.png"))
  except ValueError as e:
    raise SystemExit(f"error: plotting the run: {e}")
  from train.compile_cache import active
  print(_summary(result, time.perf_counter() - t0, png, active()), file=sys.stderr)


if __name__ == "__main__":
  with handling(lambda run_dir: resume_command(sys.argv[1:], run_dir)) as stop:
    try:
      main(stop=stop)
    except Interrupted as e:
      # No interpreter teardown either (below), and no second line from the
      # watchdog: its exit was claimed before the checkpoint's save.
      say(e.line)
      os._exit(exit_status(e.signum))
    except SystemExit as e:
      if not isinstance(e.code, str):
        raise
      # An error message: print it and skip the interpreter's teardown, where
      # TensorStore callbacks left pending by a failed write print tracebacks.
      print(e.code, file=sys.stderr)
      sys.stdout.flush()
      sys.stderr.flush()
      os._exit(1)
