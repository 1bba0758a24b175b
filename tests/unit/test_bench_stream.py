"""`kiln bench --random-shapes | --shapes-from`: a stream of request shapes, reported as a user feels it."""

from __future__ import annotations

import json

import pytest

import kiln
from kiln import zoo
from kiln.cli import main
from kiln.cli.bench_stream import parse_random_shapes, shape_stream


@pytest.fixture(scope="module")
def engine_path(tmp_path_factory):
    exported = zoo.export("bert_tiny", dynamic=True)
    path = tmp_path_factory.mktemp("stream") / "bert.kiln"
    kiln.build(str(exported.path), profiles=[{"input_ids": "1x1,2x8,3x24"}]).save(path)
    return path


def test_a_random_stream_follows_shared_symbols(engine_path):
    engine = kiln.load(engine_path)
    stream = shape_stream(engine.inputs, random_shapes="input_ids:1x1..3x24", shapes_from=None, requests=20, seed=1)
    assert len(stream) == 20
    for shapes in stream:
        assert shapes["attention_mask"] == shapes["input_ids"]
        assert 1 <= shapes["input_ids"][0] <= 3 and 1 <= shapes["input_ids"][1] <= 24


def test_bench_replays_a_stream_against_onnxruntime(engine_path, tmp_path, capsys):
    out = tmp_path / "stream.json"
    assert main(["bench", str(engine_path), "--random-shapes", "input_ids:1x1..3x24", "--requests", "8",
                 "--against", "onnxruntime", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "8 requests" in text and "onnxruntime" in text and "first call" in text
    doc = json.loads(out.read_text())
    assert doc["kiln"]["all"]["count"] == 8 and doc["onnxruntime"]["all"]["count"] == 8
    assert doc["kiln"]["signatures"] == doc["onnxruntime"]["signatures"]


def test_bench_replays_shapes_from_a_file(engine_path, tmp_path, capsys):
    shapes = tmp_path / "shapes.txt"
    shapes.write_text("input_ids:1x5\ninput_ids:2x9\n\ninput_ids:1x5\n")
    assert main(["bench", str(engine_path), "--shapes-from", str(shapes)]) == 0
    assert "3 requests, 2 distinct shapes" in capsys.readouterr().out


@pytest.mark.parametrize("spec, message", [
    ("input_ids:1x1-3x24", "expected NAME:MINxMIN..MAXxMAX"),
    ("input_ids:3x1..1x24", "MIN <= MAX"),
    ("tokens:1x1..2x2", "the shape stream names ['tokens']"),
])
def test_a_bad_stream_is_a_clear_error(engine_path, capsys, spec, message):
    assert main(["bench", str(engine_path), "--random-shapes", spec, "--requests", "2"]) == 1
    assert message in capsys.readouterr().err


def test_a_stream_shape_outside_the_profiles_is_named(engine_path, capsys):
    assert main(["bench", str(engine_path), "--random-shapes", "input_ids:4x1..4x2", "--requests", "2"]) == 1
    assert "outside every optimization profile" in capsys.readouterr().err


def test_parse_random_shapes():
    assert parse_random_shapes("a:1x1..32x512, b:2..4") == {"a": ([1, 1], [32, 512]), "b": ([2], [4])}
