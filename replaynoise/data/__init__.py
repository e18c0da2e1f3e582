"""Data: the problems, the grader, the prompts, the pinned packages and the models they come from."""
