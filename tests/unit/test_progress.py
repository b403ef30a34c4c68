"""Progress on a terminal is a bar; in a pipe or a log it is a few plain status lines."""

from quantserve.progress import Progress, track


def test_a_piped_progress_prints_plain_status_lines(capsys):
    prog = Progress(100, "train", "step", every_s=0.0)
    for n in range(1, 101):
        prog.update(n, f"loss {1 / n:.3f}")
    prog.close()
    err = capsys.readouterr().err
    assert "\r" not in err
    lines = err.splitlines()
    assert lines[-1].startswith("train: 100/100 steps, loss 0.010 (")
    assert len(lines) == 101  # every_s=0: one per update, plus the closing line


def test_status_lines_are_rate_limited(capsys):
    prog = Progress(1000, "convert", "tensor")  # every 30 s by default
    for n in range(1, 1001):
        prog.update(n)
    prog.close()
    assert capsys.readouterr().err.splitlines() == [line for line in ["convert: 1000/1000 tensors (0 s)"]]


def test_track_never_lists_a_generator(capsys):
    gen = (i for i in range(5))
    assert list(track(gen, "read", "item")) == [0, 1, 2, 3, 4]
    assert capsys.readouterr().err.strip() == "read: 5 items (0 s)"


def test_disabled_progress_is_silent(capsys):
    prog = Progress(10, "x", enabled=False)
    prog.update(5)
    prog.close()
    assert capsys.readouterr().err == ""
