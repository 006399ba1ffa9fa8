"""Evaluation while training: the validation loss, and downstream tasks through lm-evaluation-harness (an optional
package, imported only when used)."""
