"""Quiet by default: a measure notebook run prints where it writes and nothing else; the known-harmless
start-up messages (rollout_lib.core says which and why) are gone at their source, and nothing else is
hidden."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

from rollout_lib.core import KNOWN_HARMLESS_LOG_MESSAGES, notebook_kernel_options, quiet_known_warnings

from .conftest import REPO, SMOKE


def test_a_measure_notebook_run_is_quiet_and_lands_under_its_name(tmp_path):
    out = tmp_path / "outputs"
    result = subprocess.run([sys.executable, "-m", "rollout_lib.cli", "measure", "--backend", "hf_reference",
                             "--params", str(SMOKE), "--campaign", "quiet", "--output-dir", str(out), "--run-id", "q1",
                             "--cells", "p16-r8-n1-greedy", "--device", "cpu"],
                            capture_output=True, text=True, cwd=REPO, env=dict(os.environ, TQDM_DISABLE="1"),
                            timeout=600)
    assert result.returncode == 0, result.stderr
    lines = result.stderr.strip().splitlines()
    assert [line.split(":")[0] for line in lines] == ["raw file", "executed notebook"], result.stderr
    assert "IPKernelApp" not in result.stderr and "without encryption" not in result.stderr
    notebooks = list((out / "runs" / "quiet").iterdir())
    assert [p.name for p in notebooks] == [lines[1].split(": ", 1)[1].rsplit("/", 1)[1]]  # no partial beside it
    kernel_stderr = "".join("".join(o.get("text", "")) for cell in json.loads(notebooks[0].read_text())["cells"]
                            for o in cell.get("outputs", []) if o.get("name") == "stderr")
    assert "kernels-community" not in kernel_stderr and "WARNING" not in kernel_stderr, kernel_stderr


def test_only_the_named_messages_are_filtered(caplog):
    quiet_known_warnings()
    quiet_known_warnings()  # idempotent: one filter per logger
    for name, prefixes in KNOWN_HARMLESS_LOG_MESSAGES.items():
        logger = logging.getLogger(name)
        assert len(logger.filters) == 1
        with caplog.at_level(logging.WARNING, logger=name):
            logger.warning(prefixes[0] + ": %s. Please make sure", "No module named 'kernels'")
            logger.warning("another warning of the same library")
        assert [r.getMessage() for r in caplog.records if r.name == name] == ["another warning of the same library"]
        caplog.clear()


def _sigints_at_shutdown(manager_class: type, folder) -> str:
    """Start a kernel, leave it busy in a cell that records every SIGINT, shut it down; what it recorded."""
    import asyncio
    import time

    started, record = folder / "started", folder / "sigint"

    async def run() -> None:
        with notebook_kernel_options() as options:
            manager = manager_class(config=options["config"], kernel_name="python3")
            manager.shutdown_wait_time = 2.0
            await manager.start_kernel(cwd=str(folder))
            client = manager.client()
            client.start_channels()
            try:
                await client.wait_for_ready(timeout=120)
                # the handler is set inside the cell: ipykernel restores its own after each request
                client.execute(f"import signal, time, pathlib\n"
                               f"note = lambda *_: pathlib.Path({str(record)!r}).write_text('SIGINT')\n"
                               f"signal.signal(signal.SIGINT, note)\n"
                               f"pathlib.Path({str(started)!r}).write_text('')\n"
                               f"time.sleep(30)\n")
                deadline = time.monotonic() + 60
                while not started.exists():
                    assert time.monotonic() < deadline, "the cell never started"
                    await asyncio.sleep(0.05)
            finally:
                client.stop_channels()
                await manager.shutdown_kernel()
            assert not manager.has_kernel

    asyncio.run(run())
    return record.read_text() if record.exists() else ""


def test_the_notebook_kernel_is_shut_down_without_an_interrupt(tmp_path):
    """jupyter_client interrupts a kernel before shutting it down; a kernel still inside a request logs the
    KeyboardInterrupt on the run's stderr (CI saw "[IPKernelApp] ERROR | KeyboardInterrupt caught in kernel."
    after the last cell). The notebook runs' kernel manager shuts down without that SIGINT, and a busy
    kernel still ends; jupyter_client's own manager, on the same kernel, sends it."""
    from jupyter_client import AsyncKernelManager

    with notebook_kernel_options() as options:
        manager_class = options["kernel_manager_class"]
    assert issubclass(manager_class, AsyncKernelManager) and manager_class is not AsyncKernelManager
    (tmp_path / "ours").mkdir()
    (tmp_path / "stock").mkdir()
    assert _sigints_at_shutdown(manager_class, tmp_path / "ours") == ""
    assert _sigints_at_shutdown(AsyncKernelManager, tmp_path / "stock") == "SIGINT"


def test_a_notebook_run_stops_its_kernel_without_the_kernel_s_own_teardown(tmp_path):
    """The notebook runs' kernel is killed once the last cell has replied (ipykernel's teardown can abort in
    libzmq: rollout_lib.core.notebook_kernel_options): an atexit hook the kernel registered never runs, the
    cells' outputs and files are all there, and the kernel process is gone when papermill returns."""
    import nbformat
    import papermill as pm

    hook, done, pid = tmp_path / "atexit-ran", tmp_path / "cell-wrote", tmp_path / "kernel-pid"
    source = (f"import atexit, os, pathlib\n"
              f"atexit.register(lambda: pathlib.Path({str(hook)!r}).write_text('teardown ran'))\n"
              f"pathlib.Path({str(pid)!r}).write_text(str(os.getpid()))\n"
              f"pathlib.Path({str(done)!r}).write_text('written')\n"
              f"print('last cell')")
    notebook = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(source)])
    notebook.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    template, executed = tmp_path / "in.ipynb", tmp_path / "out.ipynb"
    nbformat.write(notebook, template)
    with notebook_kernel_options() as options:
        assert options["shutdown_kernel"] == "immediate"
        pm.execute_notebook(str(template), str(executed), kernel_name="python3", progress_bar=False,
                            cwd=str(tmp_path), **options)
    assert done.read_text() == "written"
    outputs = nbformat.read(executed, as_version=4).cells[0].outputs
    assert [o.get("text") for o in outputs] == ["last cell\n"]
    assert not hook.exists(), "the kernel ran its own teardown"
    kernel = int(pid.read_text())
    try:
        os.kill(kernel, 0)
    except ProcessLookupError:
        pass
    else:
        raise AssertionError(f"the kernel (pid {kernel}) outlived the run")
