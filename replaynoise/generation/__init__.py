"""Generation: rollouts and their pivots, the replay passes, and the GRPO training that makes a model."""
