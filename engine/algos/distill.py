"""On-policy distillation's advantage (Agarwal et al. 2024, arXiv 2306.13649; Thinking Machines' "On-Policy
Distillation", 2025): the student samples, the teacher scores every sampled token, and a token's advantage
is its log-ratio log p_teacher(x_t) - log p_student(x_t), the negated single-sample estimate of the reverse
KL(student || teacher) at that position. No discount and no baseline: each token is judged where it stands.
"""

from __future__ import annotations

import torch


def distillation_advantages(*, student_logp: torch.Tensor, teacher_logp: torch.Tensor,
                            response_mask: torch.Tensor) -> torch.Tensor:
    """[B, T] log-probs of the sampled tokens under the student (the distribution that sampled them) and the
    teacher -> [B, T] advantages: teacher - student on the response's tokens, 0 elsewhere."""
    return (teacher_logp - student_logp) * response_mask.to(student_logp.dtype)
