"""`python -m backends.engine --model DIR ...`: the engine's server without Django (see `server.main`)."""

from __future__ import annotations

from backends.engine.server import main

if __name__ == "__main__":
    main()
