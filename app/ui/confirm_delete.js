/* Delete voice's first step (app/ui/layout.py): the page asks before deleting a saved voice (a refusal
   throws, which ends the event); API clients are not asked. */
(voice) => {
  if (voice && !window.confirm('Delete the saved voice "' + voice + '"? This cannot be undone.')) {
    throw new Error('deletion cancelled');
  }
  return [voice];
}
