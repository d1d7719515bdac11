"""Generated parts of the docs are what their generators print now (issue #24: the kernel
report in docs/kernels.md is regenerated, never edited by hand)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is first imported

from k3compile.cli.kernel_doc import DOC_BEGIN, DOC_END, markdown_report, replace_doc_section  # noqa: E402

KERNELS_MD = Path(__file__).resolve().parents[1] / "docs" / "kernels.md"


def test_the_launch_report_in_docs_kernels_md_is_current():
    text = KERNELS_MD.read_text()
    section = text[text.index(DOC_BEGIN):text.index(DOC_END) + len(DOC_END)]
    assert section == markdown_report(), (
        "docs/kernels.md's launch report is stale: run `python -m k3compile.cli.kernel_doc docs/kernels.md`")


def test_replacing_the_section_keeps_the_rest():
    text = f"before\n{DOC_BEGIN}\nold\n{DOC_END}\nafter\n"
    assert replace_doc_section(text, f"{DOC_BEGIN}\nnew\n{DOC_END}") == f"before\n{DOC_BEGIN}\nnew\n{DOC_END}\nafter\n"
    with pytest.raises(ValueError, match="no generated launch report section"):
        replace_doc_section("no markers", "x")
