from pathlib import Path

CONF = Path("/home/user/app/service.conf")


def test_port_changed():
    assert "port=9090" in CONF.read_text().splitlines()


def test_other_lines_kept():
    lines = CONF.read_text().splitlines()
    assert lines == ["name=web", "port=9090", "workers=4"]
