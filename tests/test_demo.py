"""The README's main job, `python -m unipage.demo`, runs to the end and reports its checks."""

from unipage import demo


def test_demo_runs(capsys, tmp_path):
    demo.main(["--adapter-dir", str(tmp_path)])
    text = capsys.readouterr().out
    assert "identical to the files" in text and "all pool invariants hold" in text
    assert "each prompt alone gives the same tokens as in the mixed batch" in text
