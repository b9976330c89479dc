"""How a run is reached and followed: the control client, the viewer's frame sources (live
sockets or a recording), the recording format, the authentication of TCP endpoints."""
