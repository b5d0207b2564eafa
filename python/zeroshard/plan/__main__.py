"""``python -m zeroshard.plan``: the memory planner's command line."""

from .cli import main

main()
