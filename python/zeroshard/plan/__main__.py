"""``python -m zeroshard.plan``: the memory planner's command line."""
from .planner import main

main()
