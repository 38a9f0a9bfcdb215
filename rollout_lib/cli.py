"""`rollout`: the one command-line entry point (console script in pyproject.toml).

Every subcommand is a thin layer over the library: it parses arguments, calls one function, prints
where it wrote. Errors are one line on stderr; exit code 2 means bad input (a parameter, a file, a
preregistration), 1 means a check ran and failed, 3 means a resume from another environment.

Paths work like every CLI's: a relative path resolves against the working directory. The defaults
(params/..., outputs/, notebooks/) are taken from the project root: the nearest folder, from the
working directory upwards, that holds params/ (the way git finds .git), never from where this package
is installed. Outside any project, give every path explicitly.

Run `rollout COMMAND --help` for each command's purpose and an example.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import errno
import json
import os
import re
import signal
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from rollout_lib.core import project_root

if TYPE_CHECKING:  # the CLI imports heavy modules only inside the command that needs them
    from rollout_lib.models.train_standin import TrainKernels
    from rollout_lib.study.prereg import Preregistration

DEFAULT_PARAMS = "params/rollout-runtime-v2.yaml"
DEFAULT_CYCLE_PARAMS = "params/rollout-runtime-v2-cycle.yaml"
SMOKE_PARAMS = "params/profiles/smoke.yaml"
MESSAGE_CAP = 2000  # no error message floods a terminal (a YAML alias bomb once made 312 MB)


class CommandError(Exception):
    """Bad input found by the CLI itself: exit 2 with this one-line message."""


class ProjectPath(str):
    """A default path relative to the project root (not to the working directory); `main` resolves it."""


def _resolve_project_defaults(args: argparse.Namespace) -> None:
    """Every ProjectPath default becomes a path under the project root, shown relative to the working
    directory (`params/x.yaml` at the root, `../params/x.yaml` one folder below). The root is looked for
    only when a default is used: outside a project, explicit paths still work."""
    pending = {name: value for name, value in vars(args).items() if isinstance(value, ProjectPath)}
    if pending:
        root = project_root()
        for name, value in pending.items():
            setattr(args, name, os.path.relpath(root / value))


def _project_file(relative: str, what: str) -> Path:
    """A file the project provides (a notebook, a profile), located from the project root."""
    path = project_root() / relative
    if not path.is_file():
        raise CommandError(f"{what}: {relative} not found under the project root {path.parent.parent}")
    return path


def _one_line(exc: BaseException) -> str:
    text = str(exc) if str(exc) else type(exc).__name__
    if isinstance(exc, KeyError) and text.startswith(("'", '"')):
        text = text.strip("'\"")
    text = " ".join(text.split())
    return text if len(text) <= MESSAGE_CAP else text[:MESSAGE_CAP] + f" ... [{len(text) - MESSAGE_CAP} more chars]"


def _utc_stamp() -> str:
    return dt.datetime.now(dt.UTC).strftime("%Y%m%dT%H%M%S%fZ")


# ------------------------------------------------------------------------------------------
# Subcommands
# ------------------------------------------------------------------------------------------

def _study(path: str | os.PathLike[str]) -> Preregistration:
    """The study at `path`, with the hf_cached engine it names (if any) checked against the engine's settings, so
    a command that would run it refuses a bad one in one line before anything is written."""
    from rollout_lib.study.prereg import load

    study = load(path)
    if study.hf_cached_engine:
        from rollout_lib.backends.compact_qwen3 import check_study_engine

        try:
            check_study_engine(study)
        except ValueError as exc:
            raise CommandError(f"{path}: {exc}") from None
    return study


def cmd_prereg(args: argparse.Namespace) -> int:
    from rollout_lib.study.prereg import CALCULATOR_PENDING

    study = _study(args.path)
    calc = study.calculator.sha256
    print(f"valid: {args.path} (sha256 {study.sha256})")
    print(f"  study   {study.study_id} ({study.status_label})", file=sys.stderr)
    print(f"  actor   {study.actor.architecture.name} digest {study.actor.payload_digest}", file=sys.stderr)
    print(f"  teacher {study.teacher.architecture.name} digest {study.teacher.payload_digest}", file=sys.stderr)
    engine = ", ".join(f"{k}={v}" for k, v in sorted(study.hf_cached_engine.items()))
    print(f"  hf_cached engine: {engine or 'the defaults (no hf_cached_engine)'}", file=sys.stderr)
    if calc == CALCULATOR_PENDING:
        print("  calculator: PENDING (not frozen: any use of the calculator refuses to run)", file=sys.stderr)
    else:
        print(f"  calculator {study.calculator.path} sha256 {calc}", file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from rollout_lib.models.synthetic import bf16_round, build_snapshot, payload_digest
    from rollout_lib.study import prereg as prereg_mod
    from rollout_lib.study.arch import get_architecture

    if args.models_command == "digest":
        if not Path(args.snapshot).is_dir():
            raise CommandError(f"snapshot: {args.snapshot!r} is not a directory")
        print(payload_digest(args.snapshot))
        return 0
    if args.models_command == "verify":
        return _verify_local_snapshot(args)
    params_path = args.params or _project_file(SMOKE_PARAMS if args.arch == "tiny" else DEFAULT_PARAMS, "params")
    study = prereg_mod.load(params_path)
    model_spec = study.model_for_arch(args.arch, args.role)
    if model_spec.source != "synthetic":
        raise CommandError(f"{model_spec.role}.source: {model_spec.source!r} in {params_path}: `rollout models "
                           f"{args.models_command}` is for synthetic weights (use `rollout models verify DIR`)")
    if args.models_command == "build":
        seed = args.seed if args.seed is not None else model_spec.synthetic_seed
        scale = args.logit_scale if args.logit_scale is not None else model_spec.logit_scale
        info = build_snapshot(get_architecture(args.arch), seed, args.out, scale)
        print(f"arch={info.arch} seed={info.seed} logit_scale={info.logit_scale!r} out={info.path}", file=sys.stderr)
        pinned = model_spec.payload_digest if (seed, bf16_round(scale)) == (
            model_spec.synthetic_seed, bf16_round(model_spec.logit_scale)) else None
        print(info.payload_digest)
        if pinned and pinned != info.payload_digest:
            print(f"rollout models build: digest differs from the pin in {params_path}: {pinned}", file=sys.stderr)
            return 1
        return 0
    from rollout_lib.models.calibration import calibrate_logit_scale

    result = calibrate_logit_scale(study, args.arch, device=args.device, target_nats=args.target_nats, role=args.role)
    print(json.dumps(result, indent=2, sort_keys=True))
    return 0


def _train_kernels(args: argparse.Namespace) -> TrainKernels:
    """The named kernel set (`--kernels`), with each kernel flag given on the command line taking its place."""
    from rollout_lib.models.train_standin import KERNEL_PRESETS

    chosen = {"attention": args.attention, "loss": args.loss, "optimizer": args.optimizer, "step": args.step,
              "fill_uninitialized": None if args.fill_uninitialized is None else args.fill_uninitialized == "on"}
    return dataclasses.replace(KERNEL_PRESETS[args.kernels], **{k: v for k, v in chosen.items() if v is not None})


def cmd_models_train(args: argparse.Namespace) -> int:
    """`rollout models train`: a trained stand-in snapshot (rollout_lib/models/train_standin.py)."""
    from rollout_lib.core import write_json_atomic
    from rollout_lib.models.train_standin import (
        TrainError,
        fingerprint_mismatches,
        plan_training,
        train_standin,
    )
    from rollout_lib.study.bpe_tokenizer import TokenizerError
    from rollout_lib.study.corpus import CorpusError

    expected = None
    try:
        if args.expect is not None:
            if not Path(args.expect).is_file():
                raise CommandError(f"expect: {args.expect!r} is not a file (a rollout_trained.json record)")
            expected = json.loads(Path(args.expect).read_text())
            if not isinstance(expected, dict) or "fingerprint" not in expected:
                raise CommandError(f"expect: {args.expect} has no fingerprint (not a rollout_trained.json record)")
        if Path(args.out).exists() and not args.replace:
            raise CommandError(f"out: {args.out} exists; choose a new directory or pass --replace")
        plan = plan_training(args.arch, role=args.role, seed=args.seed, corpus=args.corpus,
                             bpe_vocab_size=args.bpe_vocab_size, steps=args.steps, device=args.device,
                             compute_dtype=args.compute_dtype,
                             kernels=_train_kernels(args))
    except (TrainError, CorpusError, TokenizerError) as err:
        raise CommandError(str(err)) from err
    print(f"training {plan.arch.name} ({plan.role}, init seed {plan.seed}) on corpus {plan.manifest.name}: "
          f"{plan.recipe.steps} steps x {plan.recipe.tokens_per_step} tokens = {plan.recipe.planned_tokens} tokens, "
          f"{plan.device} {plan.compute_dtype}; kernels {args.kernels}: attention {plan.kernels.attention}, loss "
          f"{plan.kernels.loss}, optimizer {plan.kernels.optimizer}, fill-uninitialized "
          f"{'on' if plan.kernels.fill_uninitialized else 'off'}, step {plan.kernels.step}",
          file=sys.stderr)
    record = train_standin(plan, args.out, replace_existing=args.replace,
                           log=lambda line: print(f"  {line}", file=sys.stderr))
    if args.record:
        write_json_atomic(args.record, record, overwrite=True)
    final, init = record["final_metrics"], record["init_metrics"]
    print(f"payload_digest={record['payload_digest']} held-out loss {final['heldout_loss_nats']:.4f} "
          f"(init {init['heldout_loss_nats']:.4f}) entropy {final['mean_entropy_nats']:.4f} nats "
          f"(init {init['mean_entropy_nats']:.4f}) top-1 p {final['mean_top1_probability']:.3f} "
          f"train {record['train_wall_s']:.1f} s ({record['train_tokens_per_s']:.0f} tok/s) out={args.out}",
          file=sys.stderr)
    print(record["payload_digest"])
    if expected is not None:
        if expected.get("payload_digest") == record["payload_digest"]:
            print("expect: payload digest identical (bit-exact reproduction)", file=sys.stderr)
            return 0
        problems = fingerprint_mismatches(expected, record)
        if problems:
            print(f"rollout models train: fingerprint differs from {args.expect}: {'; '.join(problems[:5])}",
                  file=sys.stderr)
            return 1
        print(f"expect: payload digest differs, fingerprint within tolerance of {args.expect}", file=sys.stderr)
    return 0


def _verify_local_snapshot(args: argparse.Namespace) -> int:
    """A downloaded snapshot against a study's actor or teacher architecture (and a digest, if given)."""
    from dataclasses import asdict

    from rollout_lib.models.local_snapshot import (
        SnapshotError,
        check_prompt_ids,
        inspect_snapshot,
        parse_snapshot_source,
        verify_snapshot,
    )
    from rollout_lib.study import prereg as prereg_mod
    from rollout_lib.study.workload import Workload

    study = prereg_mod.load(args.params)
    model = study.actor if args.role == "actor" else study.teacher
    if not Path(args.snapshot).is_dir():
        raise CommandError(f"snapshot: {args.snapshot!r} is not a directory")
    path = Path(args.snapshot).resolve()
    try:
        if args.digest is None:  # the digest is computed once and printed, to pin in the study
            snapshot = inspect_snapshot(path, model.architecture, key_path=args.role)
        else:
            spec = parse_snapshot_source({"source": "snapshot", "path": str(path), "payload_digest": args.digest},
                                         args.role)
            snapshot = verify_snapshot(spec, model.architecture, key_path=args.role)
        largest = check_prompt_ids(Workload(study), snapshot)
    except SnapshotError as err:
        raise CommandError(str(err)) from err
    print(json.dumps(asdict(snapshot) | {"largest_prompt_id": largest, "study": str(args.params),
                                         "digest_given": args.digest is not None}, indent=2, sort_keys=True))
    return 0


def measure_notebook_path(output_dir: str | Path, campaign: str, backend: str, run_id: str) -> Path:
    """A new executed-notebook path for every invocation (a resume never replaces an earlier one)."""
    folder = Path(output_dir) / "runs" / campaign
    return folder / f"measure-{backend}-{run_id}-{_utc_stamp()}.ipynb"


def _seconds_per_cell(flag: str, text: str, what: str) -> dict[str, float]:
    """A campaign worker's {cell id: seconds} flag, refused by name unless it is one."""
    try:
        found = json.loads(text or "{}")
    except ValueError as exc:
        raise CommandError(f"{flag}: not JSON ({exc})") from None
    if not isinstance(found, dict) or not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                              for v in found.values()):
        raise CommandError(f"{flag}: expected an object of cell id -> {what}")
    return found


def cmd_measure(args: argparse.Namespace) -> int:
    from rollout_lib.measure.runner import run, validate_parameters

    # everything is validated before anything is written (a bad campaign must not create folders)
    # and the machine is checked: no vLLM to import, or a GPU campaign on a CPU, is refused here
    spec, study, workload = validate_parameters(backend=args.backend, params=args.params, campaign=args.campaign,
                                                cells=args.cells, run_id=args.run_id,
                                                output_dir=args.output_dir, device=args.device, check_machine=True)
    if args.deadline_unix is not None or args.estimates_json or args.warmup_estimates_json:
        if not args.direct:
            raise CommandError("deadline-unix/estimates-json/warmup-estimates-json: only with --direct "
                               "(the campaign driver's workers)")
        estimates = _seconds_per_cell("estimates-json", args.estimates_json, "seconds per measured repetition")
        warmup_estimates = _seconds_per_cell("warmup-estimates-json", args.warmup_estimates_json,
                                             "seconds per warmup")
        # the campaign driver's order (longest first) is the order of work, not the workload's
        given = [c.strip() for c in args.cells.split(",") if c.strip()]
        spec = dataclasses.replace(spec, deadline_unix=args.deadline_unix, estimates_s=estimates,
                                   warmup_estimates_s=warmup_estimates or None,
                                   cells=tuple(dict.fromkeys(given)) if given else spec.cells)
    if args.direct:
        # SIGTERM (a driver stopping, a lease ending) unwinds like Ctrl-C: teardown is recorded and the
        # file sealed; a cell cut mid-way stays a segment that the next run continues
        signal.signal(signal.SIGTERM, signal.default_int_handler)
        print(f"raw file: {spec.path}", file=sys.stderr)
        for summary in run(spec, study, workload):
            print(json.dumps(summary.row(), sort_keys=True), flush=True)
        return 0
    import papermill as pm

    template = _project_file("notebooks/measure.ipynb", "notebook")
    notebook = measure_notebook_path(args.output_dir, spec.campaign, spec.backend, spec.run_id)
    # the kernel runs in the project root: every path it is given is absolute
    parameters = {"backend": spec.backend, "params": os.path.abspath(spec.params_path), "campaign": spec.campaign,
                  "run_id": spec.run_id, "output_dir": os.path.abspath(args.output_dir),
                  "device": args.device or "", "cells": list(spec.cells) if args.cells else []}
    print(f"raw file: {spec.path}\nexecuted notebook: {notebook}", file=sys.stderr)
    run_measure_notebook(pm, template, notebook, parameters)
    return 0


# A refusal raised inside the notebook (the run never started): its notebook is not kept
NOTEBOOK_REFUSALS = ("ParameterError", "StrictLoadError", "PreregistrationError", "UnknownBackendError",
                     "UnknownCellError", "CampaignGPUMismatch", "RawSealed", "WriterBusy", "RawIdentityDrift",
                     "RawFileError", "ProjectRootNotFound")


def run_measure_notebook(pm, template: Path, notebook: Path, parameters: dict) -> None:
    """Execute the measure notebook into a hidden temporary file beside `notebook`, renamed into place
    only when the run succeeded: a failed run never leaves a partial notebook under the good name.

    A refusal (bad input found in the kernel) keeps nothing. A failure during the work keeps its
    notebook, with the traceback, as `<name>.FAILED.ipynb`, and the message names it."""
    folder = notebook.parent
    created = [d for d in (folder, *folder.parents) if not d.exists()]
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".{notebook.stem}.partial-{os.getpid()}.ipynb"
    from rollout_lib.core import notebook_kernel_options

    try:
        with notebook_kernel_options() as kernel_options:
            pm.execute_notebook(str(template), str(partial), parameters=parameters, cwd=str(template.parent.parent),
                                kernel_name="python3", progress_bar=False, **kernel_options)
    except pm.PapermillExecutionError as exc:
        if exc.ename in NOTEBOOK_REFUSALS:
            _remove_quietly(partial, created)
            raise CommandError(f"{exc.evalue}") from None
        failed = notebook.with_name(f"{notebook.stem}.FAILED.ipynb")
        os.replace(partial, failed)
        # the one-line cause last, not buried in the notebook traceback
        raise CommandError(f"measure notebook failed: {exc.ename}: {exc.evalue} (the failed notebook is kept "
                           f"for debugging: {failed})") from None
    except BaseException:
        _remove_quietly(partial, created)
        raise
    with open(partial, "rb") as handle:
        os.fsync(handle.fileno())
    os.replace(partial, notebook)


def _remove_quietly(path: Path, created_folders: list[Path]) -> None:
    """Remove a temporary file, then the folders this command created, if they stayed empty."""
    path.unlink(missing_ok=True)
    for folder in created_folders:  # deepest first
        try:
            folder.rmdir()
        except OSError:
            break


def cmd_missing(args: argparse.Namespace) -> int:
    from rollout_lib.campaign.driver import waiting_repetitions
    from rollout_lib.evidence.publish import campaign_cells
    from rollout_lib.report.summary import cut_cell_text
    from rollout_lib.study.prereg import load

    study = load(args.params)
    measured = study.protocol.measured_repetitions
    for backend, cells in campaign_cells(study, args.campaign, Path(args.output_dir)).items():
        todo = cells["to_measure"]
        waiting = waiting_repetitions(Path(args.output_dir), args.campaign, backend, todo) if todo else {}
        # a cut cell says how far it got and under which identity its segments continue
        named = [cut_cell_text(cell, waiting.get(cell, []), measured) for cell in todo]
        print(f"{backend}: {len(todo)} to measure ({len(cells['missing'])} missing, {len(cells['invalid'])} invalid), "
              f"{len(cells['valid'])} valid" + (f": {', '.join(named)}" if todo else ""))
    return 0


def cmd_publish(args: argparse.Namespace) -> int:
    from rollout_lib.core import sha256_file
    from rollout_lib.evidence.publish import publish
    from rollout_lib.study.prereg import load

    path = publish(load(args.params), args.campaign, Path(args.output_dir))
    print(f"wrote {path} sha256 {sha256_file(path)}")
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    from rollout_lib.evidence.publish import aggregate_path, check
    from rollout_lib.study.prereg import load

    check(load(args.params), args.campaign, Path(args.output_dir))
    print(f"OK: {aggregate_path(Path(args.output_dir), args.campaign)} re-derives byte for byte")
    return 0


def cmd_report(args: argparse.Namespace) -> int:
    from rollout_lib.report.summary import render

    print(f"wrote {render(args.campaign, args.params, Path(args.output_dir), args.cycle_campaigns)}")
    return 0


def cmd_reproducibility(args: argparse.Namespace) -> int:
    """Which requests generate identical tokens across repetitions and engine starts, from the raw files."""
    import json

    from rollout_lib.evidence.reproducibility import for_campaign, summary_text
    from rollout_lib.study.prereg import load

    raw = Path(args.output_dir) / "raw" / args.campaign
    if not raw.is_dir():
        raise CommandError(f"campaign: no raw files for {args.campaign!r} under {raw}")
    result = for_campaign(load(args.params), args.campaign, Path(args.output_dir))
    print(json.dumps(result, indent=1) if args.json else summary_text(result))
    return 0


def _refuse_existing(out: Path) -> None:
    if out.exists():
        raise CommandError(f"out: {out} exists; evidence is never overwritten, choose another path")


def cmd_conformance(args: argparse.Namespace) -> int:
    from rollout_lib.backends import create_backend
    from rollout_lib.checks.conformance import (
        ConformanceSettings,
        oracle_self_consistency,
        run_conformance,
        vllm_conformance,
    )
    from rollout_lib.measure.identity import write_evidence

    study = _study(args.params)
    out = Path(args.out)
    _refuse_existing(out)
    settings = ConformanceSettings(
        prompt_tokens=tuple(args.prompt_tokens or study.workload.prompt_tokens),
        response_tokens=tuple(args.response_tokens or study.workload.response_tokens),
        samples_per_prompt=args.samples_per_prompt, policy_version=args.policy_version,
        partitions_response_tokens=tuple(args.partitions_response_tokens) if args.partitions_response_tokens else None)
    digests = {"actor": study.actor.payload_digest}
    if args.candidate_option and (args.candidate != "hf_cached" or args.oracle_self_check):
        raise CommandError("--candidate-option: only with --candidate hf_cached (not with vllm or "
                           "--oracle-self-check)")
    if args.oracle_self_check:
        report = oracle_self_consistency(study, settings, device=args.device)
        sha = write_evidence(out, report, study=study, model_digests=digests)
        noise = report["scoring_noise"]
        print(f"oracle self-consistency max |d logprob| {report['max_abs_diff']:.6f}; teacher-forced scoring "
              f"run to run {noise['run_to_run_max_abs_diff']:.6f}, batch composition "
              f"{noise['batch_composition_max_abs_diff']:.6f}; wrote {out} sha256 {sha}")
        return 0
    if args.candidate == "vllm":
        report = vllm_conformance(study, settings, create_backend("vllm", study), device=args.device)
    else:
        options = _backend_options(args.candidate_option)
        try:  # an unknown option or value is named by the backend before anything runs
            create_backend("hf_cached", study, device=args.device, **options)
        except ValueError as exc:
            raise CommandError(str(exc)) from exc
        report = run_conformance(study, settings, device=args.device, candidate_options=options)
    sha = write_evidence(out, report, study=study, model_digests=digests)
    v = report["verdict"]
    print(f"conformance {'PASSED' if v['passed'] else 'FAILED'}: {v['checks']}", file=sys.stderr)
    identical = v.get("bf16_free_running_identical", v.get("greedy_free_running_identical"))
    total = v.get("bf16_free_running_requests", v.get("greedy_free_running_requests"))
    print(f"max |d logprob| {v['max_abs_logprob_diff']:.6f}; free-running greedy identical {identical}/{total}",
          file=sys.stderr)
    print(f"wrote {out} sha256 {sha}")
    return 0 if v["passed"] else 1


def cmd_refresh(args: argparse.Namespace) -> int:
    from rollout_lib.backends import create_backend
    from rollout_lib.checks.refresh import run_refresh
    from rollout_lib.measure.identity import write_evidence

    study = _study(args.params)
    out = Path(args.out)
    _refuse_existing(out)
    options = ({"device": args.device} if args.device else {}) | _backend_options(args.backend_option)
    try:
        backend = create_backend(args.backend, study, **options)
    except ValueError as exc:  # an unknown option or value, named by the backend
        raise CommandError(str(exc)) from exc
    report = run_refresh(study, backend)
    sha = write_evidence(out, report, study=study, model_digests={"actor": study.actor.payload_digest})
    print(f"policy refresh {'PASSED' if report['verdict']['passed'] else 'FAILED'}: {report['verdict']['checks']}; "
          f"wrote {out} sha256 {sha}")
    return 0 if report["verdict"]["passed"] else 1


def cmd_vllm_diagnostic(args: argparse.Namespace) -> int:
    from rollout_lib.checks.vllm_inprocess import check_variants, run_diagnostic

    study = _study(args.params)
    out = Path(args.out)
    _refuse_existing(out)
    cells = _cells_arg(study, args.cells)
    try:
        intervals = tuple(int(n) for n in args.stream_intervals.split(",") if n.strip())
    except ValueError as exc:
        raise CommandError(f"stream-intervals: {args.stream_intervals!r} is not a list of integers >= 1, "
                           "e.g. 1,8") from exc
    variants = tuple(v.strip() for v in args.variants.split(",") if v.strip())
    written = _GrowingEvidence(out)
    try:  # run_diagnostic checks the values before it starts anything
        check_variants(variants)
        report = run_diagnostic(study, cells, args.repetitions, stream_intervals=intervals,
                                non_streamed=args.non_streamed, variants=variants,
                                hf_cached_options=_backend_options(args.hf_cached_option), rounds=args.rounds,
                                on_round=written.write)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    written.write(report)
    for row in report["rows"]:
        print(f"{row['cell_id']}: " + "; ".join(_diagnostic_figures(row)))
    print(f"wrote {out}")
    return 0


class _GrowingEvidence:
    """One run's file, rewritten (atomically) as its rounds finish, so a run stopped later keeps the rounds it
    measured. It replaces only the bytes this run wrote last: a file someone else put there is refused."""

    def __init__(self, out: Path) -> None:
        self.out, self.sha256 = out, None

    def write(self, report: dict) -> None:
        from rollout_lib.core import sha256_file, write_json_atomic

        if self.sha256 is None and self.out.exists():  # put there while the first round ran
            raise CommandError(f"out: {self.out} exists; evidence is never overwritten, choose another path")
        if self.sha256 is not None and (not self.out.is_file() or sha256_file(self.out) != self.sha256):
            raise CommandError(f"out: {self.out} changed since this run wrote it; evidence is never overwritten")
        self.sha256 = write_json_atomic(self.out, report, overwrite=self.sha256 is not None)
        if not report.get("complete", True):
            print(f"round {report['rounds']} of {report['rounds_requested']} measured; wrote {self.out} "
                  "(incomplete until the last round)", flush=True)


def _diagnostic_figures(row: dict) -> list[str]:
    """One cell of `vllm-diagnostic` in words: each measured side's rate and the ratios it allows."""
    said = []
    if "managed_tokens_per_s" in row:
        said.append(f"managed {row['managed_tokens_per_s']:.1f} tok/s"
                    + (f" ({row['managed_over_inprocess_adapter']:.3f} of in-process)"
                       if "managed_over_inprocess_adapter" in row else ""))
        said += [f"managed with stream interval {n}: {rate:.1f} tok/s"
                 for n, rate in row["managed_tokens_per_s_by_stream_interval"].items() if n != "1"]
    if "managed_non_streamed_tokens_per_s" in row:
        said.append(f"managed, non-streamed: {row['managed_non_streamed_tokens_per_s']:.1f} tok/s")
    if "inprocess_adapter_tokens_per_s" in row:
        said.append(f"in-process with adapter {row['inprocess_adapter_tokens_per_s']:.1f}")
    if "inprocess_no_adapter_tokens_per_s" in row:
        said.append(f"in-process without {row['inprocess_no_adapter_tokens_per_s']:.1f}"
                    + (f" (LoRA tax {100 * row['lora_tax_fraction']:.1f}%)" if "lora_tax_fraction" in row else ""))
    if "inprocess_no_adapter_reset_cache_tokens_per_s" in row:
        said.append(f"in-process without, prefix cache reset per call "
                    f"{row['inprocess_no_adapter_reset_cache_tokens_per_s']:.1f}")
    if "hf_cached_tokens_per_s" in row:
        step, over = row["hf_cached_median_decode_step_s"], row["hf_cached_decode_step_over_floor"]
        said.append(f"hf_cached {row['hf_cached_tokens_per_s']:.1f} tok/s"
                    + (f" ({row['hf_cached_over_inprocess_no_adapter']:.2f}x in-process without LoRA)"
                       if "hf_cached_over_inprocess_no_adapter" in row else "")
                    + (f" ({row['hf_cached_over_inprocess_no_adapter_reset_cache']:.2f}x with its prefix cache reset)"
                       if "hf_cached_over_inprocess_no_adapter_reset_cache" in row else "")
                    + (f", decode step {1000 * step:.2f} ms" if isinstance(step, float) else "")
                    + (f" = {over:.1f}x its bandwidth floor" if isinstance(over, float) else ""))
    for engine, words in (("no_adapter", "without LoRA"), ("no_adapter_reset_cache", "prefix cache reset")):
        if f"hf_cached_over_inprocess_{engine}_by_round" in row:
            said.append(f"hf_cached / in-process {words} by round: "
                        + ", ".join(f"{x:.2f}x" for x in row[f"hf_cached_over_inprocess_{engine}_by_round"]))
    return said


def cmd_vllm_compare(args: argparse.Namespace) -> int:
    from rollout_lib.checks.vllm_compare import chosen_rungs, run_comparison
    from rollout_lib.core import write_json_atomic

    study = _study(args.params)
    out = Path(args.out)
    _refuse_existing(out)
    cells = _cells_arg(study, args.cells)
    try:
        rungs = chosen_rungs(args.comparison, [r.strip() for r in args.rungs.split(",")] if args.rungs else None)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc
    # written after every rung (complete: false until the last), so a deadline keeps the rungs already
    # run: the file grows within this run only (refused above if it existed before), hence overwrite
    report = run_comparison(study, args.comparison, cells, versions=args.versions, rungs=rungs, device=args.device,
                            backend_options=_backend_options(args.backend_option),
                            on_rung=lambda partial: write_json_atomic(out, partial, overwrite=True))
    write_json_atomic(out, report, overwrite=True)
    for rung in report["rungs"]:
        if rung["status"] == "failed":
            print(f"{rung['rung']}: FAILED after {rung['rung_wall_s']:.0f} s: {rung['error']}")
            continue
        mean = rung["mean_abs_logprob_diff"]
        print(f"{rung['rung']}: max |d logprob| {rung['max_abs_logprob_diff']}, mean {mean}; "
              f"teacher-forced disagreements {rung['teacher_forced']['argmax_disagreements']}/"
              f"{rung['teacher_forced']['positions']} ({rung['teacher_forced']['beyond_tie_margin']} beyond the "
              f"tie margin); sync s {[round(x, 3) for x in rung['sync_s']]}; "
              f"tok/s {[round(c['tokens_per_s'] or 0, 1) for c in rung['cells']]}; "
              f"attention {rung['attention_backend']}")
    print(f"wrote {out}")
    return 0 if all(rung["status"] == "measured" for rung in report["rungs"]) else 1


def cmd_cycle(args: argparse.Namespace) -> int:
    from rollout_lib.measure.cycle import CycleBudgetError, run_cycles
    from rollout_lib.study.cycle import load as load_cycle

    study = load_cycle(args.params)
    if args.deadline_s is not None:
        skipped = _cycle_deadline_refusal(args, study.cycles)
        if skipped:
            print(skipped)
            return 0  # not an error: a queue goes on to its next job
    if args.address is not None and args.placement != "ray":
        raise CommandError("address: only with --placement ray")
    try:
        if args.placement == "ray":
            from rollout_lib.campaign.cycle_placement import run_cycles_on_ray
            from rollout_lib.campaign.executors import ExecutorError

            try:
                path = run_cycles_on_ray(str(args.params), args.backend, args.algorithm, args.cell, args.campaign,
                                         address=args.address, run_id=args.run_id, output_dir=Path(args.output_dir),
                                         device=args.device, cycles=args.cycles,
                                         backend_options=_backend_options(args.backend_option),
                                         vllm_memory_mode=args.vllm_memory_mode)
            except ExecutorError as exc:
                raise CommandError(str(exc)) from exc
        else:
            path = run_cycles(study, args.backend, args.algorithm, args.cell, args.campaign, run_id=args.run_id,
                              output_dir=Path(args.output_dir), device=args.device, cycles=args.cycles,
                              backend_options=_backend_options(args.backend_option),
                              vllm_memory_mode=args.vllm_memory_mode)
    except (ValueError, CycleBudgetError) as exc:
        raise CommandError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from exc
    print(f"wrote {path}")
    return 0


def _cycle_deadline_refusal(args: argparse.Namespace, cycles_required: int) -> str | None:
    """Why this cycle run is not started before `--deadline-s`, or None when it fits or has no estimate."""
    from rollout_lib.measure.cycle import estimated_run_s, rollout_lower_bound_s
    from rollout_lib.measure.runner import DEADLINE_MARGIN_S, DEADLINE_SAFETY

    if args.deadline_s <= 0:
        raise CommandError(f"deadline-s: {args.deadline_s} is not allowed; a positive number of seconds")
    found = estimated_run_s(Path(args.output_dir), args.campaign, args.backend, args.algorithm, args.cell,
                            cycles_required, args.vllm_memory_mode) or rollout_lower_bound_s(
        Path(args.output_dir), args.campaign, args.backend, args.cell, cycles_required)
    if found is None:
        print("cycle: no earlier complete run of this kind on this GPU model and no rollout of its cell to bound "
              "it; starting without an estimate")
        return None
    seconds, source = found  # a full run's: with --cycles (a probe) it over-estimates, on the safe side
    needed = seconds * DEADLINE_SAFETY + DEADLINE_MARGIN_S
    if needed <= args.deadline_s:
        print(f"cycle: estimate {seconds:.0f} s (from {source}) fits the {args.deadline_s:.0f} s left")
        return None
    return (f"cycle: skipped (deadline): estimate {seconds:.0f} s (from {source}; x{DEADLINE_SAFETY} + "
            f"{DEADLINE_MARGIN_S:.0f} s = {needed:.0f} s) does not fit the {args.deadline_s:.0f} s left, and a cycle "
            f"run cannot be continued; no raw file written")


def cmd_cycle_publish(args: argparse.Namespace) -> int:
    from rollout_lib.evidence.cycles import check_cycles, publish_cycles
    from rollout_lib.study.cycle import load as load_cycle

    study = load_cycle(args.params)
    output_dir = Path(args.output_dir)
    if args.check:
        check_cycles(study, args.campaign, output_dir)
        print(f"OK: {output_dir}/cycles/aggregate/{args.campaign}.json re-derives byte for byte")
        return 0
    path = publish_cycles(study, args.campaign, output_dir)
    print(f"wrote {path}")
    return 0


def _backend_options(pairs: list[str] | None) -> dict:
    """KEY=VALUE pairs; a VALUE that parses as JSON (a list, a number) is taken as such."""
    import json

    out = {}
    for pair in pairs or []:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise CommandError(f"backend-option: {pair!r} is not KEY=VALUE")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def _cells_arg(study, text: str) -> list[str]:
    """`--cells a,b`: the cell ids, each checked against the study's workload."""
    cells = [c.strip() for c in text.split(",") if c.strip()]
    known = set(_cell_ids(study))
    for cell in cells:
        if cell not in known:
            raise CommandError(f"cells: unknown cell id {cell!r}; valid cell ids: {', '.join(sorted(known))}")
    return cells


def _cell_ids(study) -> list[str]:
    from rollout_lib.study.workload import Workload

    return Workload(study).cell_ids()


def cmd_seal(args: argparse.Namespace) -> int:
    from rollout_lib.measure.rawfile import seal_abandoned, seal_file, seal_folder_of

    ended = "after_the_fact" if args.after_the_fact else "abandoned"
    if not args.reason.strip():
        raise CommandError("reason: must say why the file is sealed by hand (a non-empty text)")
    targets = []
    for name in args.paths:  # every target is checked before the first seal is written
        path = Path(name)
        if path.suffix not in (".jsonl", ".json"):
            raise CommandError(f"paths: {name!r} is neither a raw file (.jsonl) nor an evidence file (.json)")
        targets.append((path, seal_folder_of(path)))
    for path, folder in targets:
        if path.suffix == ".jsonl":
            entry = seal_abandoned(path, reason=args.reason, ended=ended)
        else:
            entry = seal_file(path, folder, ended="after_the_fact", reason=args.reason)
        mark = " (sealed after the fact: listed in the aggregate; counts toward a gate only if " \
            "params/evidence-allowlist.yaml names its sha256)" if entry["ended"] == "after_the_fact" else ""
        print(f"sealed {path} sha256 {entry['sha256']} ({entry['ended']}){mark}")
    return 0


def cmd_campaign(args: argparse.Namespace) -> int:
    from rollout_lib.campaign import driver

    if args.campaign_command == "scaling":  # refused before anything is read
        counts = _gpu_counts(args.gpus)
    study = _study(args.params)
    output_dir = Path(args.output_dir)
    if args.campaign_command == "status":
        print(driver.status(study, args.campaign, output_dir, args.backend))
        return 0
    if args.campaign_command == "scaling":
        from rollout_lib.campaign.scaling import campaign_scaling, format_scaling, raw_files_by_backend
        from rollout_lib.core import write_json_atomic

        if args.json is not None and Path(args.json).exists():
            raise CommandError(f"json: {args.json} exists; give a new file (an estimate is never overwritten)")
        try:
            result = campaign_scaling(study, args.campaign, raw_files_by_backend(output_dir, args.campaign), counts)
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        print(format_scaling(result))
        if args.json is not None:
            write_json_atomic(Path(args.json), result)
        return 0
    if args.backend not in ("hf_reference", "hf_cached", "vllm"):
        raise CommandError(f"backend: {args.backend!r} is not allowed; allowed: hf_reference, hf_cached, vllm")
    if args.deadline_s <= 0:
        raise CommandError(f"deadline-s: {args.deadline_s} is not allowed; a positive number of seconds")
    if args.lease_s is not None and args.lease_s < args.deadline_s:
        raise CommandError(f"lease-s: {args.lease_s} is not allowed; at least --deadline-s ({args.deadline_s}): "
                           "a job's deadline lies within one lease")
    _require_identity_prefix("expect-identity", args.expect_identity)
    if args.campaign_command == "run":  # refused before a log, a state or a raw file exists
        from rollout_lib.measure.runner import check_machine_for

        try:
            executor = driver.resolve_executor(args.executor, args.gpus, driver.visible_gpus())
        except ValueError as exc:
            raise CommandError(str(exc)) from None
        if args.address is not None and executor != "ray":
            raise CommandError("address: only with --executor ray (the address of a Ray cluster: auto or HOST:PORT)")
        if args.address is not None and args.address != "auto" and not re.fullmatch(r"[\w.\-]+:\d{1,5}", args.address):
            raise CommandError(f"address: {args.address!r} is not allowed; auto or HOST:PORT (e.g. 10.0.0.5:6379)")
        if executor == "local":  # a Ray worker's machine is checked by its own measuring process
            check_machine_for(args.backend, output_dir, args.campaign, preregistered=study.preregistered,
                              params_path=str(args.params))
        else:
            from rollout_lib.campaign.executors import ExecutorError, import_ray

            try:
                import_ray()
            except ExecutorError as exc:
                raise CommandError(str(exc)) from None
    cells = _campaign_cells_option(study, args.campaign, args.backend, output_dir, args.cells, args.exclude_cells)
    if args.campaign_command == "plan":
        identity = None
        if args.as_identity is not None:
            if args.expect_identity is not None:
                raise CommandError("as-identity: not allowed with --expect-identity (the plan would not be this "
                                   "machine's); use one of them")
            _require_identity_prefix("as-identity", args.as_identity)
            try:
                identity = driver.identity_of_raw_files(output_dir, args.campaign, args.backend, args.as_identity)
            except ValueError as exc:
                raise CommandError(str(exc)) from exc
        the_plan, calibration = driver.plan_on_this_machine(study, args.campaign, args.backend, output_dir,
                                                            args.gpus, args.deadline_s, cells, args.expect_identity,
                                                            lease_s=args.lease_s, as_identity=identity)
        print(driver.format_plan(the_plan, calibration))
        if args.forecast:
            lease_s = args.lease_s or args.deadline_s
            try:
                plans, never = driver.forecast_plans(the_plan, lease_s)
                history = driver.format_forecast_at_past_overruns(the_plan, lease_s, calibration.get("past_jobs") or [])
            except ValueError as exc:
                raise CommandError(str(exc)) from exc
            print(driver.format_forecast(plans, never, lease_s))
            if history:
                print(history)
        return 0
    if args.detach:
        log = driver.campaign_dir(output_dir, args.campaign) / "logs" / f"{args.backend}-driver-{_utc_stamp()}.log"
        # the detached driver runs in the package's tree: its paths are absolute
        argv = ["campaign", "run", "--campaign", args.campaign, "--backend", args.backend,
                "--params", os.path.abspath(args.params), "--output-dir", os.path.abspath(output_dir),
                "--deadline-s", repr(args.deadline_s)]
        argv += (["--gpus", str(args.gpus)] if args.gpus else []) + (["--cells", args.cells] if args.cells else [])
        argv += ["--exclude-cells", args.exclude_cells] if args.exclude_cells else []
        argv += ["--expect-identity", args.expect_identity] if args.expect_identity else []
        argv += ["--lease-s", repr(args.lease_s)] if args.lease_s is not None else []
        argv += ["--executor", args.executor] if args.executor else []
        argv += ["--address", args.address] if args.address else []
        pid = driver.detach(argv, log)
        print(f"campaign driver started detached: pid {pid}; log {log}; "
              f"poll with: rollout campaign status --campaign {args.campaign}")
        return 0
    from rollout_lib.campaign.executors import ExecutorError

    try:
        return driver.run_campaign(study, args.campaign, args.backend, output_dir, gpus=args.gpus,
                                   deadline_s=args.deadline_s, cells=cells, expect_identity=args.expect_identity,
                                   lease_s=args.lease_s, executor=args.executor, address=args.address)
    except ExecutorError as exc:
        raise CommandError(str(exc)) from None


def _gpu_counts(text: str) -> tuple[int, ...]:
    """`--gpus 1,2,4,8` of `campaign scaling`: distinct whole numbers of at least 1, in increasing order."""
    words = [w.strip() for w in text.split(",") if w.strip()]
    if not words or not all(re.fullmatch(r"[1-9][0-9]{0,3}", w) for w in words):
        raise CommandError(f"gpus: {text!r} is not allowed; comma-separated whole numbers from 1 to 9999 "
                           "(e.g. 1,2,4,8)")
    return tuple(sorted({int(w) for w in words}))


def _require_identity_prefix(option: str, value: str | None) -> None:
    """A measurement identity named on the command line: a lower-case hex prefix of its SHA-256."""
    if value is not None and not re.fullmatch(r"[0-9a-f]{8,64}", value):
        raise CommandError(f"{option}: {value!r} is not allowed; a lower-case hex prefix of a measurement "
                           "identity's SHA-256, 8 to 64 digits (e.g. 9988ac85)")


def _campaign_cells_option(study, campaign: str, backend: str, output_dir: Path, cells_text: str,
                           exclude_text: str) -> list[str] | None:
    """`--cells` (default: every cell still to measure) less `--exclude-cells`; None: the driver's default.
    An unknown cell id in either is refused with the allowed ones."""
    from rollout_lib.evidence.publish import campaign_cells
    from rollout_lib.study.workload import Workload

    known = Workload(study).cell_ids()
    chosen = [c.strip() for c in cells_text.split(",") if c.strip()]
    excluded = [c.strip() for c in exclude_text.split(",") if c.strip()]
    for option, ids in (("cells", chosen), ("exclude-cells", excluded)):
        unknown = [c for c in ids if c not in known]
        if unknown:
            raise CommandError(f"{option}: {', '.join(unknown)} not in the workload; allowed: {', '.join(known)}")
    if not excluded:
        return chosen or None
    base = chosen or campaign_cells(study, campaign, output_dir).get(backend, {}).get("to_measure", [])
    return [c for c in base if c not in set(excluded)]


def cmd_profile_breakdown(args: argparse.Namespace) -> int:
    from rollout_lib.core import write_json_atomic
    from rollout_lib.measure.step_profile import StepProfileError, breakdown_record, render

    out = Path(args.json) if args.json else None
    if out is not None:
        _refuse_existing(out)
    layers = args.layers
    try:  # breakdown_record checks every value before it reads the trace
        if layers is None:
            from rollout_lib.study.arch import get_architecture
            from rollout_lib.study.prereg import load

            layers = get_architecture(load(args.params).actor.architecture.name).num_hidden_layers
        record = breakdown_record(args.trace, layers, steps=args.steps, label=args.label, cell=args.cell)
    except StepProfileError as exc:
        raise CommandError(str(exc)) from exc
    print(f"{record['trace']['path']} ({record['gpu']}, cell {record['cell']}, {layers} layers)")
    print(render(record))
    if out is not None:
        write_json_atomic(out, record)
        print(f"wrote {out}", file=sys.stderr)
    return 0


def cmd_source_stamp(args: argparse.Namespace) -> int:
    from rollout_lib.measure.identity import SOURCE_STAMP, write_source_stamp

    print(json.dumps(write_source_stamp(), sort_keys=True))
    print(f"wrote {SOURCE_STAMP}", file=sys.stderr)
    return 0


# ------------------------------------------------------------------------------------------
# Parser
# ------------------------------------------------------------------------------------------

# Every command's and action's --help: (one-line purpose, example). `_explain` attaches them; a test
# checks that no subcommand is missing.
EXPLAINED: dict[str, tuple[str, str]] = {
    "prereg": ("Validate a preregistration or profile and print its SHA-256; writes nothing.",
               "rollout prereg params/profiles/smoke.yaml"),
    "models": ("Model snapshots: build a synthetic one, digest or verify a local one, calibrate a logit scale.",
               "rollout models digest .cache/snapshots/tiny-seed1"),
    "models build": ("Write a synthetic HF snapshot (config.json + safetensors) and print its payload digest.",
                     "rollout models build --arch tiny --out /tmp/tiny-actor"),
    "models digest": ("Print the payload digest of any snapshot directory (synthetic or hub); writes nothing.",
                      "rollout models digest /tmp/tiny-actor"),
    "models verify": ("Check a local (e.g. downloaded) snapshot against a study's actor or teacher.",
                      "rollout models verify ~/models/Qwen3-0.6B --role actor --params params/rollout-runtime-v2.yaml"),
    "models train": ("Train a Qwen3-shape stand-in on the offline corpus; write its HF snapshot, print its digest.",
                     "rollout models train --arch tiny --out /tmp/tiny-trained"),
    "models calibrate": ("Measure next-token entropy on the workload and pick the logit scale (prints JSON).",
                         "rollout models calibrate --arch tiny --device cpu"),
    "measure": ("Measure one backend over a campaign's cells through notebooks/measure.ipynb (or --direct).",
                "rollout measure --backend hf_cached --campaign smoke --params params/profiles/smoke.yaml "
                "--output-dir outputs/smoke"),
    "missing": ("List the cells of a campaign still to measure, per backend; writes nothing.",
                "rollout missing --campaign h200-v2"),
    "publish": ("Apply the frozen calculator to a campaign's sealed raw files: writes its aggregate JSON.",
                "rollout publish --campaign smoke --params params/profiles/smoke.yaml --output-dir outputs/smoke"),
    "check": ("Re-derive a campaign's aggregate byte for byte from its raw files; writes nothing.",
              "rollout check --campaign h200-v2"),
    "report": ("Render a campaign's report: the summary notebook, then a self-contained HTML page.",
               "rollout report --campaign smoke --params params/profiles/smoke.yaml --output-dir outputs/smoke"),
    "reproducibility": ("Count the requests whose tokens repeat across repetitions and engine starts; writes "
                        "nothing.", "rollout reproducibility --campaign h200-v2"),
    "conformance": ("Measure a candidate's exactness against the NF4 oracle; writes an evidence JSON.",
                    "rollout conformance --params params/profiles/smoke.yaml --device cpu --out /tmp/conformance.json"),
    "refresh": ("Eight policy refreshes through one backend, then the teardown proof; writes an evidence JSON.",
                "rollout refresh --backend hf_cached --params params/profiles/smoke.yaml --out /tmp/refresh.json"),
    "campaign": ("A campaign over GPU jobs: plan what is missing, run it (one GPU here, or a Ray cluster), follow it.",
                 "rollout campaign status --campaign h200-v2"),
    "campaign plan": ("Print the longest-first schedule of what is missing, with estimates; writes nothing.",
                      "rollout campaign plan --campaign h200-v2 --backend hf_cached --deadline-s 1500"),
    "campaign run": ("Measure what is missing, one process per GPU (local, or --executor ray), until --deadline-s.",
                     "rollout campaign run --campaign h200-v2 --backend hf_cached --deadline-s 1500 --executor ray "
                     "--address auto"),
    "campaign status": ("Show done / running / to-measure cells, each driver's state and when it was written.",
                        "rollout campaign status --campaign h200-v2"),
    "campaign scaling": ("Estimate how long the whole campaign takes on 1, 2, 4, 8 GPUs from its measured cells; "
                         "writes nothing unless --json.",
                         "rollout campaign scaling --campaign h200-v2 --gpus 1,2,4,8"),
    "vllm-diagnostic": ("Compare managed vLLM with the in-process engine on the same requests (diagnostic).",
                        "rollout vllm-diagnostic --cells p128-r64-n1-greedy --out /tmp/vllm-diagnostic.json"),
    "vllm-compare": ("Compare vLLM settings side by side on the same requests (diagnostic, no gate).",
                     "rollout vllm-compare --comparison ladder --cells p128-r64-n4-stochastic --out /tmp/ladder.json"),
    "cycle": ("Measure the full RL cycle for one backend, algorithm and cell; writes a sealed raw file.",
              "rollout cycle --params params/profiles/smoke-cycle.yaml --backend hf_cached --algorithm direct_gkd "
              "--cell p16-r24-n2-stochastic --campaign smoke --output-dir outputs/smoke"),
    "cycle-publish": ("Apply the frozen cycle calculator to a cycle campaign (--check: re-derive byte for byte).",
                      "rollout cycle-publish --params params/profiles/smoke-cycle.yaml --campaign smoke "
                      "--output-dir outputs/smoke --check"),
    "seal": ("Seal raw files whose run will not be resumed into the SEALS.jsonl manifest beside them.",
             "rollout seal outputs/raw/h200-v2/vllm/20261202T101500Z-g0.jsonl --reason 'lease ended, writer dead'"),
    "profile-breakdown": ("Break a profiled decode window down per step: kernels, GEMMs, attention, norms, LoRA, "
                          "sampling, gaps.",
                          "rollout profile-breakdown outputs/smoke/profiles/smoke/hf_cached/RUN-CELL.trace.json.gz "
                          "--params params/profiles/smoke.yaml --json /tmp/breakdown.json"),
    "source-stamp": ("Write .source-commit (commit + dirty flag) for a tree copied without .git.",
                     "rollout source-stamp"),
}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    """{'measure': parser, 'campaign run': parser, ...}: every subcommand and action, depth first."""
    found: dict[str, argparse.ArgumentParser] = {}
    for action in parser._actions:  # argparse keeps subparsers only here
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                found[name] = child
                found.update({f"{name} {k}": v for k, v in _subparsers(child).items()})
    return found


def _explain(parser: argparse.ArgumentParser) -> None:
    """Give every subcommand's --help its purpose (description) and an example (epilog)."""
    for name, child in _subparsers(parser).items():
        if name in EXPLAINED:
            purpose, example = EXPLAINED[name]
            child.description = purpose
            child.epilog = f"example:\n  {example}"
            child.formatter_class = argparse.RawDescriptionHelpFormatter


def _common(parser: argparse.ArgumentParser, *, campaign: bool = False, output_dir: bool = False) -> None:
    parser.add_argument("--params", default=ProjectPath(DEFAULT_PARAMS),
                        help=f"preregistration or profile YAML (default: {DEFAULT_PARAMS} in the project root)")
    if campaign:
        parser.add_argument("--campaign", required=True, help="campaign name, e.g. h200-v2 or smoke (lower-case "
                                                              "letters, digits, '.', '_', '-'; at most 64)")
    if output_dir:
        parser.add_argument("--output-dir", default=ProjectPath("outputs"),
                            help="root of raw/, aggregate/, report/, runs/ (default: outputs/ in the project root)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="rollout", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("prereg", help="validate a preregistration or profile; print its SHA-256 (writes nothing)")
    p.add_argument("path", nargs="?", default=ProjectPath(DEFAULT_PARAMS),
                   help=f"the YAML file (default: {DEFAULT_PARAMS} in the project root)")
    p.set_defaults(func=cmd_prereg)

    models = sub.add_parser("models", help="snapshots: build (synthetic), digest, verify (local), calibrate")
    msub = models.add_subparsers(dest="models_command", required=True, metavar="ACTION")
    build = msub.add_parser("build", help="write a synthetic HF snapshot to --out and print its payload digest")
    build.add_argument("--arch", required=True, choices=("qwen3-0.6b", "qwen3-1.7b", "tiny"))
    build.add_argument("--out", required=True, help="directory to write (config.json, model.safetensors, tokenizer)")
    build.add_argument("--params", default=None,
                       help="study whose actor/teacher with this arch gives seed and logit scale "
                            "(default: the preregistration; the smoke profile for 'tiny')")
    build.add_argument("--role", choices=("actor", "teacher"), default=None)
    build.add_argument("--seed", type=int, default=None, help="override the seed from --params")
    build.add_argument("--logit-scale", type=float, default=None, help="override the scale from --params")
    digest = msub.add_parser("digest",
                             help="payload digest of any snapshot directory (synthetic or hub); writes nothing")
    digest.add_argument("snapshot")
    verify = msub.add_parser("verify", help="check a local (e.g. downloaded) snapshot against a study's actor or "
                                            "teacher: config.json fields, tokenizer, prompt ids, and --digest if given")
    verify.add_argument("snapshot")
    verify.add_argument("--params", default=ProjectPath(DEFAULT_PARAMS))
    verify.add_argument("--role", choices=("actor", "teacher"), default="actor")
    verify.add_argument("--digest", default=None, help="the payload digest to expect (default: computed, printed)")
    calibrate = msub.add_parser("calibrate", help="measure entropy on the workload and pick the logit scale "
                                                  "(prints JSON; writes snapshots under .cache/)")
    calibrate.add_argument("--arch", required=True, choices=("qwen3-0.6b", "qwen3-1.7b", "tiny"))
    calibrate.add_argument("--params", default=None)
    calibrate.add_argument("--role", choices=("actor", "teacher"), default=None)
    calibrate.add_argument("--device", default="cpu")
    calibrate.add_argument("--target-nats", type=float, default=None)
    for p in (build, digest, verify, calibrate):
        p.set_defaults(func=cmd_models)
    train = msub.add_parser("train", help="train a stand-in from its seeded init on the offline corpus (held-out "
                                          "loss curve, entropy, top-1 histogram in rollout_trained.json)")
    train.add_argument("--arch", required=True, choices=("qwen3-0.6b", "qwen3-1.7b", "tiny"))
    train.add_argument("--out", required=True, help="snapshot directory to write (atomically; must not exist)")
    train.add_argument("--role", choices=("actor", "teacher"), default=None,
                       help="picks the init seed (default: teacher for qwen3-1.7b, actor otherwise)")
    train.add_argument("--seed", type=int, default=None, help="override the init seed (also the data order)")
    train.add_argument("--corpus", default=None, help="corpus manifest (default: params/corpora/transformers-5.17.0"
                                                      ".json; the -generation one for tiny)")
    train.add_argument("--bpe-vocab-size", type=int, default=None, help="regular BPE tokens (default 32768; 512 tiny)")
    train.add_argument("--steps", type=int, default=None, help="override the recipe's optimizer steps")
    train.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    train.add_argument("--compute-dtype", choices=("bfloat16", "float32"), default=None,
                       help="default: bfloat16 autocast on CUDA, float32 on CPU")
    train.add_argument("--kernels", choices=("reference", "fast"), default="reference",
                       help="a named set of the kernel choices below: reference (eager attention, full loss, "
                            "foreach AdamW, NaN fill on, eager step: lease 22's stand-ins) or fast (sdpa, fused, "
                            "fill off: x1.55 per actor step on an H200, also deterministic); a flag below "
                            "overrides its part")
    train.add_argument("--attention", choices=("eager", "sdpa"), default=None,
                       help="attention in training: eager (the reference) or sdpa (FlashAttention-2 with its "
                            "deterministic backward; nondeterministic ops then raise instead of warning)")
    train.add_argument("--loss", choices=("full", "chunked"), default=None,
                       help="head + cross-entropy over the whole batch (the reference) or per 1,024 tokens, "
                            "recomputed in backward")
    train.add_argument("--optimizer", choices=("foreach", "fused"), default=None,
                       help="AdamW implementation: foreach (the reference) or fused")
    train.add_argument("--fill-uninitialized", choices=("on", "off"), default=None,
                       help="torch's NaN fill of fresh allocations under deterministic algorithms (on: the "
                            "reference; off changes no result unless a kernel reads memory it did not write)")
    train.add_argument("--step", choices=("eager", "graph"), default=None,
                       help="eager (the reference) or graph: the whole step captured as one CUDA graph after 3 "
                            "eager steps and replayed (CUDA and --attention sdpa only)")
    train.add_argument("--record", default=None, help="also write the record JSON here")
    train.add_argument("--expect", default=None, help="a previous rollout_trained.json: exit 1 unless the digest "
                                                      "matches or the fingerprint is within tolerance")
    train.add_argument("--replace", action="store_true", help="replace an existing --out after success")
    train.set_defaults(func=cmd_models_train)

    p = sub.add_parser("measure", help="measure one backend through notebooks/measure.ipynb; raw JSONL under "
                                       "<output-dir>/raw/<campaign>/<backend>/<run-id>.jsonl, a new executed "
                                       "notebook under <output-dir>/runs/<campaign>/ per invocation")
    p.add_argument("--backend", required=True, help="hf_reference, hf_cached or vllm")
    _common(p, campaign=True, output_dir=True)
    p.add_argument("--cells", default="", help="comma-separated cell ids (default: all)")
    p.add_argument("--run-id", default="", help="resume this run id (default: a new UTC timestamp; letters, "
                                                "digits, '.', '_', '-'; at most 64)")
    p.add_argument("--device", default="", help="'' (auto), cpu, cuda or cuda:N")
    p.add_argument("--direct", action="store_true",
                   help="run in this process, no notebook (prints one JSON line per cell)")
    p.add_argument("--deadline-unix", type=float, default=None,
                   help="(campaign workers) start no repetition that would end after this UNIX time")
    p.add_argument("--estimates-json", default="",
                   help="(campaign workers) {cell id: seconds per measured repetition}")
    p.add_argument("--warmup-estimates-json", default="", help="(campaign workers) {cell id: seconds per warmup}")
    p.set_defaults(func=cmd_measure)

    p = sub.add_parser("missing",
                       help="cells of a campaign still missing, per backend (reads raw files, writes nothing)")
    _common(p, campaign=True, output_dir=True)
    p.set_defaults(func=cmd_missing)

    p = sub.add_parser("publish", help="apply the frozen calculator: writes <output-dir>/aggregate/<campaign>.json")
    _common(p, campaign=True, output_dir=True)
    p.set_defaults(func=cmd_publish)

    p = sub.add_parser("check", help="re-derive the aggregate byte for byte from the raw files (writes nothing)")
    _common(p, campaign=True, output_dir=True)
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("report", help="summary notebook -> <output-dir>/report/<campaign>.html (and .ipynb)")
    _common(p, campaign=True, output_dir=True)
    p.add_argument("--cycle-campaigns", default="",
                   help="comma-separated cycle campaigns shown side by side in the full-cycle section "
                        "(default: <campaign> and <campaign>-*)")
    p.set_defaults(func=cmd_report)

    p = sub.add_parser("reproducibility", help="requests whose tokens repeat across repetitions and engine starts "
                       "(from the raw files; writes nothing), e.g. rollout reproducibility --campaign h200-v2")
    _common(p, campaign=True, output_dir=True)
    p.add_argument("--json", action="store_true", help="print the counts as JSON instead of sentences")
    p.set_defaults(func=cmd_reproducibility)

    p = sub.add_parser("conformance", help="exactness of a candidate against the NF4 oracle; writes the JSON --out")
    _common(p)
    p.add_argument("--out", required=True, help="JSON file to create (never overwritten)")
    p.add_argument("--prompt-tokens", type=int, nargs="*", default=None)
    p.add_argument("--response-tokens", type=int, nargs="*", default=None)
    p.add_argument("--partitions-response-tokens", type=int, nargs="*", default=None)
    p.add_argument("--samples-per-prompt", type=int, default=1)
    p.add_argument("--policy-version", type=int, default=1)
    p.add_argument("--device", default=None)
    p.add_argument("--candidate", choices=("hf_cached", "vllm"), default="hf_cached",
                   help="hf_cached (two-part local conformance) or vllm (engine vs the NF4 oracle)")
    p.add_argument("--oracle-self-check", action="store_true",
                   help="only the diagnostic: the oracle's generation log-probs vs its own teacher-forced "
                        "scoring, and that scoring against itself (run to run, batch composition)")
    p.add_argument("--candidate-option", action="append", default=None, metavar="KEY=VALUE",
                   help="an hf_cached backend option for a diagnostic run (e.g. lora_add=bf16_like_nf4_oracle, "
                        "or engine='{\"LORA_SHRINK\": \"in_base_gemm\"}'): the report's kind is then "
                        "local_conformance_diagnostic, which no gate reads")
    p.set_defaults(func=cmd_conformance)

    p = sub.add_parser("refresh", help="eight policy refreshes through one backend + teardown proof; writes --out")
    p.add_argument("--backend", required=True, help="hf_reference, hf_cached or vllm")
    _common(p)
    p.add_argument("--out", required=True, help="JSON file to create (never overwritten)")
    p.add_argument("--device", default=None)
    p.add_argument("--backend-option", action="append", default=None, metavar="KEY=VALUE",
                   help="a backend option, repeatable (e.g. refresh=merged for vllm; JSON values allowed)")
    p.set_defaults(func=cmd_refresh)

    campaign = sub.add_parser("campaign", help="a campaign over GPU leases: plan, run (detachable), status; "
                                               "raw files as measure, driver state under <output-dir>/campaigns/")
    csub = campaign.add_subparsers(dest="campaign_command", required=True, metavar="ACTION")
    for action, text in (("plan", "print the longest-first schedule of what is missing, with estimates"),
                         ("run", "measure what is missing: one process per GPU, bounded by --deadline-s"),
                         ("status", "done / running / to-measure cells, current cell and repetition, ETA")):
        p = csub.add_parser(action, help=text)
        _common(p, campaign=True, output_dir=True)
        p.add_argument("--backend", default=None if action == "status" else "hf_reference",
                       help="hf_reference, hf_cached or vllm")
        if action != "status":
            p.add_argument("--gpus", type=int, default=None,
                           help="GPUs to use (default: 1 with the local executor; every GPU of the Ray cluster with "
                                "--executor ray); more than one means --executor ray")
            p.add_argument("--deadline-s", type=float, default=1500.0,
                           help="seconds from now after which no repetition may end (default 1500)")
            p.add_argument("--lease-s", type=float, default=None,
                           help="the longest deadline one lease gives a job (default: --deadline-s): a cell that "
                                "fits it is not split across leases (each segment repeats the warmup) unless "
                                "the end of this job has time no whole cell fits")
            p.add_argument("--cells", default="", help="restrict to these cell ids (default: all to measure)")
            p.add_argument("--exclude-cells", default="",
                           help="leave these cell ids out (e.g. cells another job continues under another "
                                "measurement identity)")
            p.add_argument("--expect-identity", default=None, metavar="SHA256_PREFIX",
                           help="refuse to plan or measure unless this machine's measurement identity starts "
                                "with this hex prefix (at least 8 digits): a job meant to continue cut cells "
                                "under a known identity must not start them afresh under another one")
        if action == "run":
            p.add_argument("--detach", action="store_true", help="run in its own process session and return")
            p.add_argument("--executor", choices=("local", "ray"), default=None,
                           help="local: one GPU (or the CPU) of this machine, no Ray; ray: one worker per GPU of a "
                                "Ray cluster (docs/ray.md). Default: local for one GPU, ray for more")
            p.add_argument("--address", default=None, metavar="auto|HOST:PORT",
                           help="(--executor ray) the Ray cluster to join; default: RAY_ADDRESS, a cluster started "
                                "on this machine, else a new local one")
        if action == "plan":
            p.add_argument("--as-identity", default=None, metavar="SHA256_PREFIX",
                           help="cost cut cells' continuations under this measurement identity of the campaign's "
                                "raw files instead of probing this machine's (plan a GPU lease from a CPU)")
            p.add_argument("--forecast", action="store_true",
                           help="then plan successive leases of --lease-s until every cell is planned, if the "
                                "estimates hold: how many leases, and which segments are cut")
        p.set_defaults(func=cmd_campaign)
    p = csub.add_parser("scaling", help="how long the whole campaign takes on 1, 2, 4, 8 GPUs, estimated from its "
                                        "measured cells (longest-first, backends one after another)")
    _common(p, campaign=True, output_dir=True)
    p.add_argument("--gpus", default="1,2,4,8", help="comma-separated GPU counts (default 1,2,4,8)")
    p.add_argument("--json", default=None, help="also write the estimate to this new JSON file")
    p.set_defaults(func=cmd_campaign)

    p = sub.add_parser("vllm-diagnostic", help="managed vLLM vs the in-process engine (with and without the "
                                               "adapter) on the same requests; writes the JSON --out")
    _common(p)
    p.add_argument("--cells", required=True, help="comma-separated cell ids")
    p.add_argument("--stream-intervals", default="1", metavar="N,M",
                   help="the managed backend once per value of its stream_interval option (default 1, the "
                        "preregistered one event per token; e.g. 1,8)")
    p.add_argument("--non-streamed", action="store_true",
                   help="also measure the managed backend with non-streamed requests (streaming: false), "
                        "beside the preregistered streamed setting")
    p.add_argument("--variants", default="managed,inprocess_adapter,inprocess_no_adapter",
                   help="which sides run, each in its own process: managed, inprocess_adapter, "
                        "inprocess_no_adapter, inprocess_no_adapter_reset_cache (the same engine, its prefix "
                        "cache reset before each call: no reuse of the warm-up's prompt KV), hf_cached (this "
                        "project's fast path, judged against the engines without LoRA; default: the three "
                        "vLLM sides managed, inprocess_adapter, inprocess_no_adapter)")
    p.add_argument("--hf-cached-option", action="append", default=None, metavar="KEY=VALUE",
                   help="an option of the hf_cached side, e.g. engine='{\"LORA_SHRINK\": \"in_base_gemm\"}' "
                        "(a candidate of issue 43)")
    p.add_argument("--repetitions", type=int, default=3)
    p.add_argument("--rounds", type=int, default=1,
                   help="measure the in-process engines and hf_cached this many times, interleaved, each time in "
                        "a fresh process; each side's median over the rounds is compared, each round's ratio "
                        "shown (default 1; not with managed); after each round but the last, --out holds the "
                        "rounds measured so far, marked incomplete")
    p.add_argument("--out", required=True, help="JSON file to create (an existing file is refused)")
    p.set_defaults(func=cmd_vllm_diagnostic)

    p = sub.add_parser("vllm-compare", help="vLLM settings side by side on the same requests (diagnostic, no gate): "
                                            "the PG-k1 precision ladder, or adapter vs merged refresh; writes --out")
    _common(p)
    p.add_argument("--comparison", required=True, choices=["ladder", "refresh-paths"])
    p.add_argument("--cells", required=True, help="comma-separated cell ids (stochastic: |d logprob|; greedy: "
                                                  "teacher-forced argmax)")
    p.add_argument("--rungs", default=None, help="comma-separated subset of the comparison's settings")
    p.add_argument("--versions", type=int, default=2, help="policy versions synced per setting (each timed)")
    p.add_argument("--device", default=None, help="device of the NF4 actor that scores")
    p.add_argument("--backend-option", action="append", default=None, metavar="KEY=VALUE",
                   help="an option for every vllm setting, repeatable (JSON values allowed)")
    p.add_argument("--out", required=True, help="JSON file to create (never overwritten)")
    p.set_defaults(func=cmd_vllm_compare)

    p = sub.add_parser("cycle", help="the full RL cycle (rollout, teacher scoring, actor scoring, one optimizer "
                                     "step, policy sync) for one backend, algorithm and cell; writes a sealed raw file "
                                     "under <output-dir>/cycles/raw/<campaign>/<backend>/")
    p.add_argument("--params", default=ProjectPath(DEFAULT_CYCLE_PARAMS), help="the cycle preregistration")
    p.add_argument("--backend", required=True, help="hf_cached, vllm or hf_reference")
    p.add_argument("--algorithm", required=True, help="direct_gkd or pg_k1")
    p.add_argument("--cell", required=True, help="a cell of the cycle study")
    p.add_argument("--campaign", required=True)
    p.add_argument("--run-id", default=None)
    p.add_argument("--cycles", type=int, default=None, help="fewer cycles than the study's (a probe)")
    p.add_argument("--output-dir", default=ProjectPath("outputs"))
    p.add_argument("--device", default=None)
    p.add_argument("--backend-option", action="append", default=None, metavar="KEY=VALUE")
    p.add_argument("--vllm-memory-mode", default=None, help="vllm only: sleep (engine sleeps while the trainer works) "
                                                            "or small_kv (awake, smaller KV cache)")
    p.add_argument("--deadline-s", type=float, default=None,
                   help="seconds from now by which the run must end: a run cannot be continued, so none is "
                        "started whose estimate (the newest complete run of its kind on this GPU model, with "
                        "the campaign runner's safety factor and margin) does not fit; without an earlier run "
                        "it starts")
    p.add_argument("--placement", choices=("process", "ray"), default="process",
                   help="process: backend, teacher and trainer in this process (the default); ray: the backend in a "
                        "Ray actor and the trainer in another, sharing one GPU (docs/ray.md)")
    p.add_argument("--address", default=None,
                   help="with --placement ray: the Ray cluster (auto or HOST:PORT; default: RAY_ADDRESS, a cluster "
                        "started on this machine, else a local one)")
    p.set_defaults(func=cmd_cycle)

    p = sub.add_parser("cycle-publish", help="the frozen cycle calculator over a cycle campaign's sealed raw files; "
                                             "writes <output-dir>/cycles/aggregate/<campaign>.json (--check: "
                                             "re-derive and compare byte for byte)")
    p.add_argument("--params", default=ProjectPath(DEFAULT_CYCLE_PARAMS), help="the cycle preregistration")
    p.add_argument("--campaign", required=True)
    p.add_argument("--output-dir", default=ProjectPath("outputs"))
    p.add_argument("--check", action="store_true")
    p.set_defaults(func=cmd_cycle_publish)

    p = sub.add_parser("seal", help="seal raw files whose run will not be resumed (writer dead), or older finished "
                                    "files, into SEALS.jsonl beside them (appends; refuses a live writer)")
    p.add_argument("paths", nargs="+", help="raw .jsonl files or evidence .json files")
    p.add_argument("--reason", required=True, help="why: recorded in the seal (and in an abandoned raw file)")
    p.add_argument("--after-the-fact", action="store_true",
                   help="a finished file from before seals existed: sealed byte for byte, nothing appended")
    p.set_defaults(func=cmd_seal)

    p = sub.add_parser("profile-breakdown", help="per-step GPU kernel breakdown of a Chrome trace (the measure "
                                                 "notebook's profile_cell); writes JSON only with --json")
    p.add_argument("trace", help="a torch-profiler Chrome trace (.json or .json.gz) of whole decode steps")
    _common(p)
    p.add_argument("--layers", type=int, default=None,
                   help="decoder layers (one attention call each per step; default: the --params actor's)")
    p.add_argument("--steps", type=float, default=None,
                   help="decode steps in the window (default: counted from the read-backs, else attention calls)")
    p.add_argument("--cell", default=None, help="the cell id the trace profiled (default: read from the file name)")
    p.add_argument("--label", default="", help="what was profiled, e.g. an engine's name (shown in the report)")
    p.add_argument("--json", default=None, help="also write the breakdown record here (never overwrites)")
    p.set_defaults(func=cmd_profile_breakdown)

    p = sub.add_parser("source-stamp", help="write .source-commit (commit + dirty flag) for a tree copied without .git")
    p.set_defaults(func=cmd_source_stamp)
    _explain(parser)
    return parser


def _bad_input_types() -> tuple[type[BaseException], ...]:
    from rollout_lib.backends.base import UnknownBackendError
    from rollout_lib.campaign.driver import IdentityMismatch
    from rollout_lib.core import BadName, CanonicalJSONError
    from rollout_lib.measure.campaign_files import CampaignGPUMismatch
    from rollout_lib.measure.rawfile import RawFileError, RawSealed, SealError, WriterBusy
    from rollout_lib.measure.runner import ParameterError
    from rollout_lib.models.synthetic import DigestMismatchError
    from rollout_lib.study.arch import UnknownArchitectureError
    from rollout_lib.study.strict import StrictLoadError
    from rollout_lib.study.workload import UnknownCellError

    return (CommandError, StrictLoadError, ParameterError, UnknownBackendError, UnknownCellError,
            UnknownArchitectureError, DigestMismatchError, CanonicalJSONError, FileNotFoundError, FileExistsError,
            IsADirectoryError, UnicodeDecodeError, RawFileError, RawSealed, SealError, WriterBusy,
            CampaignGPUMismatch, IdentityMismatch, BadName)


def _check_names(args: argparse.Namespace) -> None:
    """Run ids and campaign names are checked before any command touches a file (they become paths);
    publish, check and report also need the campaign to have raw files (missing and measure may name a
    new one)."""
    from rollout_lib.measure.runner import check_campaign_name, check_run_id

    if isinstance(getattr(args, "campaign", None), str):
        check_campaign_name(args.campaign)
    if getattr(args, "run_id", None):
        check_run_id(args.run_id)
    if args.command in ("publish", "check", "report"):
        _require_raw_files(Path(args.output_dir), args.campaign)


def _require_raw_files(output_dir: Path, campaign: str) -> None:
    """A campaign that publish/check/report reads must have raw files under this output tree."""
    raw = output_dir / "raw"
    if (raw / campaign).is_dir() and any((raw / campaign).glob("*/*.jsonl")):
        return
    known = sorted(d.name for d in raw.iterdir() if d.is_dir() and any(d.glob("*/*.jsonl"))) if raw.is_dir() else []
    raise CommandError(f"campaign: {campaign!r} has no raw files under {raw}; allowed: "
                       + (", ".join(known) if known else "none yet (measure first)"))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    func: Callable[[argparse.Namespace], int] = args.func
    from rollout_lib.evidence.admission import AllowlistError
    from rollout_lib.evidence.publish import CalculatorHashMismatch, EvidenceRefused, NoRawFiles, PublishCheckFailed
    from rollout_lib.measure.runner import RawIdentityDrift
    from rollout_lib.safe_read import UnsafeInput

    name = f"rollout {args.command}"
    from rollout_lib.core import quiet_known_warnings

    quiet_known_warnings()
    if args.command in CHILD_STARTING_COMMANDS:  # servers, engines, kernels die with this process
        from rollout_lib.lifetime import start_reaper

        start_reaper()
    try:
        _resolve_project_defaults(args)
        _check_names(args)
        return func(args)
    except (CalculatorHashMismatch, PublishCheckFailed, EvidenceRefused) as exc:
        print(f"{name}: FAILED: {_one_line(exc)}", file=sys.stderr)
        return 1
    except RawIdentityDrift as exc:
        print(f"{name}: error: {_one_line(exc)}", file=sys.stderr)
        return 3
    except (*_bad_input_types(), NoRawFiles, UnsafeInput, AllowlistError) as exc:
        print(f"{name}: error: {_one_line(exc)}", file=sys.stderr)
        return 2
    except OSError as exc:  # the file system refused: one line, exit 2 (outputs are atomic: nothing partial)
        if exc.errno not in _FILE_SYSTEM_ERRNOS:
            raise
        where = f" ({exc.filename})" if exc.filename else ""
        print(f"{name}: error: {exc.strerror or _one_line(exc)}{where}: {_FILE_SYSTEM_ERRNOS[exc.errno]}; "
              "the previous outputs are unchanged", file=sys.stderr)
        return 2


# `campaign run` is left out: its workers are detached on purpose and outlive the command
CHILD_STARTING_COMMANDS = ("measure", "conformance", "refresh", "vllm-diagnostic", "vllm-compare", "cycle", "report")
_FILE_SYSTEM_ERRNOS = {errno.ENOSPC: "free space on the output's file system", errno.EDQUOT: "raise the disk quota",
                       errno.EROFS: "the output folder is read-only: choose a writable --output-dir",
                       errno.EACCES: "no permission to write there: choose a writable --output-dir",
                       errno.EPERM: "no permission to write there: choose a writable --output-dir"}


if __name__ == "__main__":
    raise SystemExit(main())
