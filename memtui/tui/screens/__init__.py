"""The viewer's screens: the main one, help, and the modals that edit or cancel a change."""
