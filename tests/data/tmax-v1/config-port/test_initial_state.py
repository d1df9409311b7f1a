from pathlib import Path

CONF = Path("/home/user/app/service.conf")


def test_conf_exists():
    assert CONF.is_file()


def test_port_is_8080():
    assert "port=8080" in CONF.read_text().splitlines()
