"""``scripts/gpu_async_mixed.py``: its phase table, on the CPU with the tiny dummy model."""

from __future__ import annotations

import sys

import pytest

import asymcache_core.model_runner as model_runner
from tests.conftest import load_script


def test_the_script_times_each_phase_of_decode_and_prompt_steps(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    script = load_script("gpu_async_mixed")
    argv = ["gpu_async_mixed.py", "--device", "cpu", "--model", "dummy:tiny", "--decodes", "2", "--context", "32",
            "--prompts", "20,40", "--every", "3", "--steps", "9"]
    monkeypatch.setattr(sys, "argv", argv)
    pack_step = model_runner.pack_step
    script.main()
    assert model_runner.pack_step is pack_step  # its wrappers are undone
    out = capsys.readouterr().out
    tables = out.split("\n== ")[1:]
    # the engines with async scheduling on and off; on the CPU it stays off
    assert [t.split(":")[0] for t in tables] == ["sync", "sync"]
    for text in tables:
        table = text.splitlines()
        header = table[1].split()
        assert {"kind", "n", "pack", "metadata", "launch-plan", "eager-forward", "schedule", "step"} <= set(header)
        loop = [line for line in table if line.startswith("loop: ")]
        assert len(loop) == 1 and float(loop[0].split()[1]) > 0  # the whole loop's ms a step
        rows = {line.split()[0]: line.split()[1:] for line in table[2:] if line.strip() and line not in loop}
        assert all(len(cells) == len(header) - 1 for cells in rows.values())
        # nine steps: a prompt added at steps 0, 3 and 6 (20, 40, 20 tokens), the rest decodes
        assert {kind: int(cells[0]) for kind, cells in rows.items()} == {"+20": 2, "+40": 1, "decode": 6}
        step = header.index("step") - 1
        assert all(float(cells[step]) > 0 for cells in rows.values())
