"""``python -m launcher`` is ``pslaunch``."""

from .cli import main

if __name__ == "__main__":
    main(prog_name="python -m launcher")
