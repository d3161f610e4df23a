#!/bin/sh
# multiprocessing's spawn runs this as the interpreter of a role's engine processes (spawns.py)
exec "$ROLE_SPAWN_PYTHON" -S -E "$(dirname "$0")/spawns.py" "$@"
