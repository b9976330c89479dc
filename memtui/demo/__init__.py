"""The bundled demo training (imports torch; run as ``python -m memtui.demo``)."""
