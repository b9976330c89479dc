"""Unit tests of the run model and the viewer's panels, drawn without a terminal."""
