"""Analysis: the passes' credit compared, the paper's statistics and ours, the controls, the prefix mismatch."""
