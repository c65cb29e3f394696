"""Tables and pictures of what a tapped model holds."""
