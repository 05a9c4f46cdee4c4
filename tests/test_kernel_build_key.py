"""The C++ kernels' build folder is keyed by their sources and flags, so two
checkouts (or two versions of the kernels) on one machine never rebuild each
other's: nothing here compiles."""
from __future__ import annotations

from carpool.model import cpu_kernels
from carpool.model.cpu_kernels import kernel_build_dir, sources_key

FLAGS = ["-O3", "-march=native"]


def test_same_sources_same_folder_other_text_or_flags_another(tmp_path):
    source = tmp_path / "kernel.cpp"
    source.write_text("int f() { return 1; }\n")
    first = kernel_build_dir("2.13.0", [str(source)], FLAGS)
    assert kernel_build_dir("2.13.0", [str(source)], FLAGS) == first
    assert sources_key([str(source)], FLAGS) == first.name.rsplit("-", 1)[1]
    assert len(sources_key([str(source)], FLAGS)) == 12

    source.write_text("int f() { return 2; }\n")  # one character changed
    changed = kernel_build_dir("2.13.0", [str(source)], FLAGS)
    assert changed != first and changed.parent == first.parent
    source.write_text("int f() { return 1; }\n")  # back: the first folder again
    assert kernel_build_dir("2.13.0", [str(source)], FLAGS) == first

    assert kernel_build_dir("2.13.0", [str(source)], [*FLAGS, "-ffast-math"]) != first
    assert kernel_build_dir("2.14.0", [str(source)], FLAGS) != first


def test_a_checkout_elsewhere_builds_in_its_own_folder(tmp_path):
    # torch's ninja file names each source by path: a shared folder would be
    # rebuilt at every switch between the checkouts, even with equal sources.
    mine, theirs = tmp_path / "a" / "kernel.cpp", tmp_path / "b" / "kernel.cpp"
    for path in (mine, theirs):
        path.parent.mkdir()
        path.write_text("int f() { return 1; }\n")
    assert sources_key([str(mine)], FLAGS) != sources_key([str(theirs)], FLAGS)


def test_the_default_key_covers_every_source_header_and_flag(monkeypatch):
    seen = {}
    monkeypatch.setattr(cpu_kernels, "sources_key",
                        lambda sources, flags: seen.update(s=list(sources), f=list(flags)) or "k")
    assert kernel_build_dir("2.13.0").name.endswith("-k")
    assert list(seen["s"]) == [*cpu_kernels._SOURCES, *cpu_kernels._HEADERS]
    assert list(seen["f"]) == [*cpu_kernels._CFLAGS, *cpu_kernels._LDFLAGS]
    # torch's load() appends its libraries to the flag lists it is given: a
    # list here would move the key (and the next build) after the first load.
    for names in (cpu_kernels._SOURCES, cpu_kernels._HEADERS, cpu_kernels._CFLAGS,
                  cpu_kernels._LDFLAGS):
        assert isinstance(names, tuple)
