// Web Storage where the browser allows it. Absent or throwing (storage disabled, a private mode,
// a full quota), a value simply lasts as long as the page.

/** ``window.sessionStorage`` or ``window.localStorage``, or null where it is refused. */
export function storage(kind) {
  try {
    return window[kind];
  } catch {
    return null;
  }
}

/** Keep ``value`` under ``name`` (an empty value removes it); a refusal is not an error. */
export function keep(store, name, value) {
  try {
    if (value) store?.setItem(name, value);
    else store?.removeItem(name);
  } catch {
    // storage full or refused: the value lasts as long as the page
  }
}
