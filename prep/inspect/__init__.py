"""``xprep inspect``: statistics, the reports on datasets, packs and runs, and their text and HTML rendering. Uses
dataset and pack.

What other stages (and train/, cli.py) may import is what this file exports; inside the stage, modules
import each other directly.
"""

from xprep.prep.inspect.dataset_report import dataset_report
from xprep.prep.inspect.html import check_target, write_page
from xprep.prep.inspect.options import InspectOptions, kind_of
from xprep.prep.inspect.pack_report import outcome_report, pack_report
from xprep.prep.inspect.text import render, summary_lines, to_json, warning_lines

__all__ = [
    "InspectOptions", "check_target", "dataset_report", "kind_of", "outcome_report", "pack_report", "render",
    "summary_lines", "to_json", "warning_lines", "write_page"
]
