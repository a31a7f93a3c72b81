"""Debugging aids: dumps of graphs, profiles, maps and plans."""
