"""benchmarks/record.py on the CPU: the header names the GPU it ran on (UUID, power limit, top
SM clock) where nvidia-smi answers for torch's device, and leaves the line out elsewhere."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest
import torch


@pytest.fixture(scope="module")
def record(import_benchmark):
    return import_benchmark("record")


def answering(answer):
    """subprocess.run with nvidia-smi answering `answer` (raised if an exception); git runs."""
    real = subprocess.run

    def run(command, **kwargs):
        if command[0] != "nvidia-smi":
            return real(command, **kwargs)
        if isinstance(answer, Exception):
            raise answer
        return SimpleNamespace(stdout=answer)

    return run


@pytest.fixture
def an_nvidia_gpu(monkeypatch):
    props = SimpleNamespace(pci_domain_id=0, pci_bus_id=0x1B, pci_device_id=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: props)


def test_header_names_the_gpu_by_its_bus_id(record, an_nvidia_gpu, monkeypatch):
    asked = []
    answer = answering("GPU-3f2a, 700.00 W, 1980 MHz\n")

    def nvidia_smi(command, **kwargs):
        asked.append(command)
        return answer(command, **kwargs)

    monkeypatch.setattr(subprocess, "run", nvidia_smi)
    assert record.gpu_state() == "GPU-3f2a, power limit 700.00 W, max SM clock 1980 MHz"
    assert asked[0][:3] == ["nvidia-smi", "-i", "00000000:1B:00.0"]
    lines = record.header("MoE", "NVIDIA H200")
    assert lines[4] == "- gpu: GPU-3f2a, power limit 700.00 W, max SM clock 1980 MHz"
    assert lines[3] == "- device: NVIDIA H200" and lines[5].startswith("- versions: ")


@pytest.mark.parametrize(
    "answer",
    [
        FileNotFoundError("nvidia-smi"),
        subprocess.CalledProcessError(6, "nvidia-smi"),
        "No devices were found\n",
    ],
)
def test_header_leaves_the_gpu_out_where_nvidia_smi_cannot_say(
    record, an_nvidia_gpu, monkeypatch, answer
):
    monkeypatch.setattr(subprocess, "run", answering(answer))
    assert record.gpu_state() is None
    assert not any(line.startswith("- gpu:") for line in record.header("MoE", "NVIDIA H200"))


def test_no_gpu_line_without_a_cuda_gpu(record, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert record.gpu_state() is None


def test_a_section_replaces_its_own_and_keeps_the_others(record, monkeypatch, tmp_path):
    monkeypatch.setattr(record, "RESULTS", tmp_path)
    monkeypatch.setattr(record, "REPO", tmp_path)
    path = tmp_path / "moe_h200.md"
    path.write_text("# written whole, before sections\n")
    record.write("moe", ["# 120B", "", "| a |"], device="NVIDIA H200", section="gpt-oss-120b")
    record.write("moe", ["# 20B", "old"], device="NVIDIA H200", section="gpt-oss-20b")
    record.write("moe", ["# 20B", "new"], device="NVIDIA H200", section="gpt-oss-20b")
    assert path.read_text() == (
        "<!-- section: gpt-oss-120b -->\n\n# 120B\n\n| a |\n\n"
        "<!-- section: gpt-oss-20b -->\n\n# 20B\nnew\n"
    )
    record.write("moe", ["# 120B", "again"], device="NVIDIA H200", section="gpt-oss-120b")
    assert path.read_text().startswith("<!-- section: gpt-oss-120b -->\n\n# 120B\nagain\n\n")
    assert path.read_text().endswith("<!-- section: gpt-oss-20b -->\n\n# 20B\nnew\n")
    record.write("moe", ["# whole"], device="NVIDIA H200", record=False, section="gpt-oss-20b")
    assert "# whole" not in path.read_text()
