"""Results files: what write_results writes reads back as the same document, with number lists on one line."""

from __future__ import annotations

import json

from bench.common import results_json, write_results


def test_results_json_round_trips_and_keeps_number_lists_on_one_line(tmp_path):
    doc = {"curve": [1, 2.5, -3e-05, 1e20], "nested": {"rows": [[1, 2], [3]], "names": ["a", "b"]}, "empty": []}
    text = results_json(doc)
    assert json.loads(text) == doc
    assert '"curve": [1, 2.5, -3e-05, 1e+20]' in text and '"names": [\n' in text  # strings keep a line each
    path = write_results("r", {"x": 1.0}, doc, results_dir=tmp_path)
    assert json.loads(path.read_text())["raw"] == doc
