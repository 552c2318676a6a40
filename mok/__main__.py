"""`python -m mok COMMAND [options]`: see mok.app.cli."""

from mok.app.cli import main

if __name__ == "__main__":
    main()
