"""What the tests share: starting trainings and commands, the viewer's replays and screens, a second user, TensorBoard files read back."""
