"""Data the course generates itself: nothing is downloaded."""
