"""Davit operator: reconciles InferenceService objects into engine Deployments."""
