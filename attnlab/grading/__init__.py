"""Grading: exercises generated from solutions, inline checks, the grader and working copies."""
