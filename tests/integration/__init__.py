"""Tests that start processes (trainings, commands, sockets to other processes) or run the viewer."""
