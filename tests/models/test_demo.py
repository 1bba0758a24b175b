"""The README's first command, `python -m kiln.demo`, end to end (short benchmark)."""

from __future__ import annotations

import re

from kiln import demo


def test_imagenet_classes_are_the_standard_list():
    classes = demo.imagenet_classes()
    assert classes[0] == "tench, Tinca tinca"
    assert classes[281] == "tabby, tabby cat" and classes[285] == "Egyptian cat"
    assert classes[999] == "toilet tissue, toilet paper, bathroom tissue"


def test_demo_classifies_the_photos_and_benches(capsys):
    demo.main(["--iterations", "10", "--warmup", "1", "--budget", "1"])
    out = capsys.readouterr().out
    chelsea = out.split("chelsea (", 1)[1]
    top1 = int(re.search(r"top-1 .*\[(\d+)\]", chelsea).group(1))
    assert 281 <= top1 <= 285, f"the cat came out class {top1}:\n{out}"
    for photo in demo.PHOTOS:
        assert f"  {photo} (" in out
    for runtime in ("kiln", "onnxruntime", "torch eager"):
        assert re.search(rf"^  {runtime}.*\d+\.\d\d", out, re.MULTILINE), out
