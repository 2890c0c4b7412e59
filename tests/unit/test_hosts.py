from __future__ import annotations

import pytest

from launcher.errors import ConfigError
from launcher.spec.hosts import parse_lines, read_hostfile
from launcher.spec.job import Host


def parse(text: str) -> list[Host]:
    return list(parse_lines(text.splitlines(), "hosts"))


def test_every_form() -> None:
    hosts = parse("""
# a comment
node1
node2:2222   # trailing comment
alice@node3
alice@10.0.0.4:2200
[fe80::1]:2222
bob@[::1]
fe80::2
node5 slots=4
carol@node6:23 slots=1
""")
    got = [(h.user, h.name, h.port, h.slots) for h in hosts]
    assert got == [
        (None, "node1", None, None),
        (None, "node2", 2222, None),
        ("alice", "node3", None, None),
        ("alice", "10.0.0.4", 2200, None),
        (None, "fe80::1", 2222, None),
        ("bob", "::1", None, None),
        (None, "fe80::2", None, None),
        (None, "node5", None, 4),
        ("carol", "node6", 23, 1),
    ]
    assert hosts[1].origin == "hosts:4"
    assert hosts[4].display == "[fe80::1]:2222"
    assert hosts[3].display == "alice@10.0.0.4:2200"


@pytest.mark.parametrize("line, message", [
    ("node:abc", "hosts:1: port 'abc' is not a number from 1 to 65535"),
    ("node:0", "hosts:1: port '0' is not a number from 1 to 65535"),
    ("node:70000", "hosts:1: port '70000' is not a number from 1 to 65535"),
    ("-oProxyCommand=x", "hosts:1: bad host name '-oProxyCommand=x'"),
    ("-bad@node", "hosts:1: bad user name '-bad'"),
    ("no de", "hosts:1: unexpected 'de' after the host"),
    ("node slots=0", "hosts:1: slots='0' must be a whole number from 1 to 20,000"),
    ("node slots=x", "hosts:1: slots='x' must be a whole number from 1 to 20,000"),
    ("node slots=2 slots=3", "hosts:1: slots given twice"),
    ("node max_slots=2", "hosts:1: unknown setting 'max_slots'"),
    ("[fe80::1", "hosts:1: missing ']' after IPv6 address"),
    ("[fe80::1]2222", "hosts:1: expected ':PORT' after ']'"),
    ("[zz::1]:22", "hosts:1: 'zz::1' is not a valid IPv6 address"),
    ("a:b:c", "hosts:1: 'a:b:c' is not a valid IPv6 address"),
    ("node;rm", "hosts:1: bad host name 'node;rm'"),
])
def test_bad_lines_name_file_and_line(line: str, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse(line)
    assert str(e.value).startswith(message)
    assert "\n" not in str(e.value)


def test_error_line_number_counts_comments_and_blanks() -> None:
    with pytest.raises(ConfigError, match=r"^hosts:4: "):
        parse("# c\n\ngood\nbad:port\n")


def test_empty_file_is_an_error() -> None:
    with pytest.raises(ConfigError, match="hosts: no hosts found"):
        parse("# only comments\n\n")


def test_unreadable_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="cannot read hostfile .*missing"):
        read_hostfile(str(tmp_path / "missing"))
    (tmp_path / "bin").write_bytes(b"\xff\xfe\x00")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_hostfile(str(tmp_path / "bin"))


def test_example_hostfile_parses() -> None:
    from conftest import REPO
    hosts = read_hostfile(str(REPO / "hosts.example"))
    assert len(hosts) >= 5


# --- -H inline lists, stdin, limits ---------------------------------------------------------------


def test_inline_list_uses_the_hostfile_grammar() -> None:
    from launcher.spec.hosts import parse_host_list

    hosts = parse_host_list("h1,h2:2222,alice@h3,[fd00::1]:22, h4 slots=2 ")
    assert [(h.name, h.port, h.user, h.slots) for h in hosts] == [
        ("h1", None, None, None), ("h2", 2222, None, None), ("h3", None, "alice", None),
        ("fd00::1", 22, None, None), ("h4", None, None, 2)]
    assert [h.origin for h in hosts][:2] == ["-H item 1", "-H item 2"]
    with pytest.raises(ConfigError, match=r"^-H item 2: port 'x' is not a number"):
        parse_host_list("h1,h2:x")


def test_a_name_that_is_a_file_stays_a_file(tmp_path, monkeypatch) -> None:
    from launcher.spec.hosts import is_host_list, read_hosts

    monkeypatch.chdir(tmp_path)
    (tmp_path / "hosts").write_text("from-file\n")
    assert [h.name for h in read_hosts("hosts")] == ["from-file"]
    assert [h.name for h in read_hosts("h1,h2")] == ["h1", "h2"]
    assert [h.name for h in read_hosts("single")] == ["single"]
    assert not is_host_list("-") and not is_host_list("dir/missing") and is_host_list("missing")
    with pytest.raises(ConfigError, match="cannot read hostfile dir/missing"):
        read_hosts("dir/missing")


def test_stdin_and_the_size_limit(tmp_path) -> None:
    import io

    from launcher.spec.hosts import MAX_HOSTFILE_BYTES

    assert [h.name for h in read_hostfile("-", io.BytesIO(b"a\nb:22\n"))] == ["a", "b"]
    with pytest.raises(ConfigError, match=r"^hostfile <stdin> is larger than 1024 KiB"):
        read_hostfile("-", io.BytesIO(b"a\n" * (MAX_HOSTFILE_BYTES // 2 + 1)))
    (tmp_path / "long").write_text("# " + "x" * 5000 + "\na\n")
    with pytest.raises(ConfigError, match=r"long:1: a line of 5,002 characters is too long"):
        read_hostfile(str(tmp_path / "long"))
    with pytest.raises(ConfigError, match="is not a regular file"):
        read_hostfile("/dev/null")
